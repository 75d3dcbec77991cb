//! The volume graph ("volfile"): which layers a stack has, how they connect, and their options.
//!
//! A volfile is TOML: a list of `[[layer]]` tables, top layer first. Each has a unique `name`,
//! a `type` and the type's options; `subvolumes` names its children (default: the next layer
//! in the list, for layers that take a child). Unknown types and options are errors, never
//! ignored:
//!
//! ```toml
//! [[layer]]
//! name = "client-top"
//! type = "io-stats"
//!
//! [[layer]]
//! name = "brick"
//! type = "protocol-client"
//! remote = "tcp:127.0.0.1:24100"
//! ```
//!
//! Generic layers (io-stats, error-gen, delay-gen) are built here; the side that owns the rest
//! (posix and dispatch on the brick, protocol-client on the client) builds those.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::faults::{Effect, Fault, Trigger};
use crate::iostats::IoStats;
use crate::LayerRef;

/// Builds the layer types a side owns, given the definition and its built children.
pub type LeafBuilder<'b> = dyn FnMut(&LayerDef, Vec<LayerRef>) -> Result<LayerRef, String> + 'b;

/// A parsed volume graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Volfile {
    /// The layers, top first.
    #[serde(rename = "layer")]
    pub layers: Vec<LayerDef>,
}

/// One layer of the graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerDef {
    /// Unique within the graph; io-stats reports and metrics use it.
    pub name: String,
    /// Children by name; empty means "the next layer", for types that take one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subvolumes: Vec<String>,
    /// The type and its options.
    #[serde(flatten)]
    pub kind: LayerKind,
}

/// Layer types and their options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LayerKind {
    /// Counts and times every fop (see [`crate::iostats`]).
    IoStats {},
    /// Fails chosen fops with an errno.
    ErrorGen {
        /// Fop names (e.g. `["read", "write"]`); empty: all.
        #[serde(default)]
        fops: Vec<String>,
        /// The errno to return, by name (`EIO`, `ENOSPC`, …) or number.
        #[serde(default = "default_errno")]
        error: String,
        /// Chance that a matching fop fails, 0..=1.
        #[serde(default = "one")]
        probability: f64,
        /// Seed of the generator that decides.
        #[serde(default = "default_seed")]
        seed: u64,
    },
    /// Delays chosen fops.
    DelayGen {
        /// Fop names; empty: all.
        #[serde(default)]
        fops: Vec<String>,
        /// The delay, microseconds.
        delay_us: u64,
        /// Chance that a matching fop is delayed, 0..=1.
        #[serde(default = "one")]
        probability: f64,
        /// Seed of the generator that decides.
        #[serde(default = "default_seed")]
        seed: u64,
    },
    /// Brick storage: a directory on a local file system (brick side).
    Posix {
        /// The brick directory.
        directory: PathBuf,
        /// Clients' root runs as nobody (65534) on this brick (like NFS `root_squash`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        root_squash: bool,
        /// Flush-behind window in bytes: a file's dirty pages are written back after every
        /// window written through one open file, so a snapshot's reflink or an fsync waits for
        /// about three windows per writer at most (0: left to the kernel).
        #[serde(
            default = "default_flush_behind",
            skip_serializing_if = "is_default_flush_behind"
        )]
        flush_behind: u64,
    },
    /// Runs fops that may block for long (fsync, fallocate, discard) on a thread pool and the
    /// rest inline (brick side).
    Dispatch {},
    /// Spreads files over its subvolumes by a hash of the name (client side).
    Distribute {
        /// Subvolumes (by name) that take no new files: bricks being drained before their
        /// removal. Their files are still found, and moved off by a rebalance.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        draining: Vec<String>,
    },
    /// Splits big files into pieces spread over the replica sets (client side; see
    /// [`crate::shard`]).
    Shard {
        /// Bytes per piece of files created from now on: a power of two, 1 MiB to 1 TiB.
        block_size: u64,
    },
    /// Keeps every file on all its subvolumes; writes need a quorum (client side).
    Replicate {
        /// Successful replicas a change needs; default: a majority.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quorum: Option<u32>,
        /// Seconds a change waits for a quorum of replicas to come back before it fails;
        /// default 30.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout: Option<u32>,
    },
    /// Per-file records of what replicas missed, and range locks for heal (brick side).
    Marks {
        /// The brick directory (its `.kiln` holds the records).
        directory: PathBuf,
        /// Who the brick is: its volume's id and its index there (`.kiln/identity`); a
        /// directory without one is a new brick, rebuilt by heal before it is read from.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        identity: Option<crate::layers::marks::Identity>,
        /// The volume's first start: a directory without an identity takes it at once.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        adopt: bool,
    },
    /// A connection to one brick (client side).
    ProtocolClient {
        /// The brick's address: `tcp:HOST:PORT`, `HOST:PORT` or `unix:PATH`.
        remote: String,
        /// Seconds a fop waits for a lost connection to come back before it fails; default
        /// 30, or 0 under a replicate layer (which goes on with the other replicas and waits
        /// for a quorum itself).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        timeout: Option<u32>,
        /// Reads straight from the brick's files while it is on this host (a Unix socket) and
        /// grants them; default on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        short_circuit: Option<bool>,
        /// Milliseconds a connection with requests waiting may go without a byte from the
        /// brick (its host acknowledging nothing either) before the brick is away; 0 never.
        /// Default 1200. One value per process: the last graph built sets it (a graph without
        /// it, the default), unless `KILN_PING_TIMEOUT_MS` is set. Clients older than this
        /// field cannot read a graph that has it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ping_timeout: Option<u32>,
    },
}

fn default_errno() -> String {
    "EIO".into()
}
fn default_flush_behind() -> u64 {
    crate::layers::posix::DEFAULT_FLUSH_BEHIND
}

fn is_default_flush_behind(v: &u64) -> bool {
    *v == default_flush_behind()
}

fn one() -> f64 {
    1.0
}
fn default_seed() -> u64 {
    0x6b69_6c6e
}

impl LayerKind {
    /// The type's name as written in a volfile.
    pub fn type_name(&self) -> &'static str {
        match self {
            LayerKind::IoStats {} => "io-stats",
            LayerKind::ErrorGen { .. } => "error-gen",
            LayerKind::DelayGen { .. } => "delay-gen",
            LayerKind::Posix { .. } => "posix",
            LayerKind::Dispatch {} => "dispatch",
            LayerKind::ProtocolClient { .. } => "protocol-client",
            LayerKind::Distribute { .. } => "distribute",
            LayerKind::Shard { .. } => "shard",
            LayerKind::Replicate { .. } => "replicate",
            LayerKind::Marks { .. } => "marks",
        }
    }

    /// True for types that take several subvolumes.
    pub fn is_cluster(&self) -> bool {
        matches!(
            self,
            LayerKind::Distribute { .. } | LayerKind::Replicate { .. }
        )
    }

    /// True for types at the bottom of a stack.
    pub fn is_leaf(&self) -> bool {
        matches!(
            self,
            LayerKind::Posix { .. } | LayerKind::ProtocolClient { .. }
        )
    }
}

/// One documented option of a layer type.
pub struct OptionDoc {
    /// Option name.
    pub name: &'static str,
    /// Its type.
    pub ty: &'static str,
    /// Default, or "required".
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
}

/// One documented layer type.
pub struct TypeDoc {
    /// Type name.
    pub name: &'static str,
    /// Which stacks it may be in.
    pub side: &'static str,
    /// What it does.
    pub doc: &'static str,
    /// Its options.
    pub options: &'static [OptionDoc],
}

const FOPS_DOC: OptionDoc = OptionDoc {
    name: "fops",
    ty: "list of fop names",
    default: "[] (all fops)",
    doc: "fops it applies to, e.g. [\"read\", \"write\"]",
};
const PROB_DOC: OptionDoc = OptionDoc {
    name: "probability",
    ty: "number 0..=1",
    default: "1.0",
    doc: "chance that a matching fop is hit",
};
const SEED_DOC: OptionDoc = OptionDoc {
    name: "seed",
    ty: "integer",
    default: "fixed",
    doc: "seed of the generator that decides (runs repeat)",
};

/// Every layer type, its options and defaults (`kiln volume layers` prints this).
pub const TYPES: &[TypeDoc] = &[
    TypeDoc {
        name: "io-stats",
        side: "client, brick",
        doc: "per-fop calls, errors, bytes, latency histogram and block sizes; traced requests get a stamp on the way down and up",
        options: &[],
    },
    TypeDoc {
        name: "error-gen",
        side: "client, brick",
        doc: "fails matching fops with an errno, without calling below",
        options: &[
            FOPS_DOC,
            OptionDoc { name: "error", ty: "errno name or number", default: "EIO", doc: "the error returned" },
            PROB_DOC,
            SEED_DOC,
        ],
    },
    TypeDoc {
        name: "delay-gen",
        side: "client, brick",
        doc: "holds matching fops back, holding the calling thread as a slow device would",
        options: &[
            FOPS_DOC,
            OptionDoc { name: "delay_us", ty: "integer (µs)", default: "required", doc: "the delay" },
            PROB_DOC,
            SEED_DOC,
        ],
    },
    TypeDoc {
        name: "dispatch",
        side: "brick",
        doc: "runs fops that may block for long (fsync, fallocate, discard) on a thread pool, the rest inline",
        options: &[],
    },
    TypeDoc {
        name: "posix",
        side: "brick (leaf)",
        doc: "stores files in a directory; every path is resolved beneath it (openat2 RESOLVE_BENEATH)",
        options: &[
            OptionDoc { name: "directory", ty: "path", default: "required", doc: "the brick directory" },
            OptionDoc { name: "root_squash", ty: "bool", default: "false", doc: "clients' root acts as nobody (65534)" },
            OptionDoc { name: "flush_behind", ty: "bytes", default: "0", doc: "write a file's dirty pages back after every this many bytes written through one open file, bounding what a snapshot or fsync waits for; 0 leaves it to the kernel" },
        ],
    },
    TypeDoc {
        name: "distribute",
        side: "client",
        doc: "spreads files over its subvolumes by a hash of the name, per-directory layouts; directories exist on every subvolume",
        options: &[],
    },
    TypeDoc {
        name: "shard",
        side: "client",
        doc: "stores files created from now on in pieces of block_size bytes striped over the replica sets (pieces in the hidden .shards directory); files made before stay whole",
        options: &[OptionDoc { name: "block_size", ty: "bytes, a power of two from 1 MiB to 1 TiB", default: "required", doc: "bytes per piece" }],
    },
    TypeDoc {
        name: "replicate",
        side: "client",
        doc: "keeps every file on all subvolumes: changes go to all in parallel and need a quorum, misses are marked on the bricks and healed, reads go to one up-to-date replica",
        options: &[
            OptionDoc { name: "quorum", ty: "integer", default: "majority", doc: "successful replicas a change needs" },
            OptionDoc { name: "timeout", ty: "seconds", default: "30", doc: "how long a change waits for a quorum of replicas to come back before it fails" },
        ],
    },
    TypeDoc {
        name: "marks",
        side: "brick",
        doc: "records, per file, the ranges other replicas missed (kept in the brick's .kiln directory) and holds writes back from ranges a heal has locked",
        options: &[OptionDoc { name: "directory", ty: "path", default: "required", doc: "the brick directory" }],
    },
    TypeDoc {
        name: "protocol-client",
        side: "client (leaf)",
        doc: "one connection to a brick; many requests in flight, replies received into the caller's memory",
        options: &[
            OptionDoc { name: "remote", ty: "address", default: "required", doc: "tcp:HOST:PORT, HOST:PORT or unix:PATH" },
            OptionDoc { name: "timeout", ty: "seconds", default: "30 (0 under replicate)", doc: "how long a fop waits for a lost connection to come back (reconnecting, reopening handles, sending again) before it fails with ENOTCONN" },
        ],
    },
];

/// Errno names error-gen accepts.
const ERRNOS: &[(&str, u32)] = &[
    ("EPERM", 1),
    ("ENOENT", 2),
    ("EIO", 5),
    ("EBADF", 9),
    ("EAGAIN", 11),
    ("ENOMEM", 12),
    ("EACCES", 13),
    ("EBUSY", 16),
    ("EEXIST", 17),
    ("EINVAL", 22),
    ("ENOSPC", 28),
    ("EROFS", 30),
    ("ENOTCONN", 107),
    ("ETIMEDOUT", 110),
    ("ESTALE", 116),
    ("EDQUOT", 122),
];

/// Parses an errno given by name or number.
pub fn parse_errno(s: &str) -> Result<u32, String> {
    if let Ok(n) = s.parse::<u32>() {
        if (1..4096).contains(&n) {
            return Ok(n);
        }
    }
    ERRNOS
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(s))
        .map(|(_, v)| *v)
        .ok_or_else(|| format!("unknown errno {s:?}"))
}

impl Volfile {
    /// Parses and checks a volfile.
    pub fn parse(text: &str) -> Result<Volfile, String> {
        let v: Volfile = toml::from_str(text).map_err(|e| format!("bad volfile: {e}"))?;
        v.check()?;
        Ok(v)
    }

    /// Reads and parses a volfile.
    pub fn load(path: &std::path::Path) -> Result<Volfile, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read volfile {}: {e}", path.display()))?;
        Volfile::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The volfile as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a volfile always serialises")
    }

    /// Names are unique, subvolumes exist, leaves have none, the graph has no cycles and every
    /// layer is reachable from the top.
    pub fn check(&self) -> Result<(), String> {
        if self.layers.is_empty() {
            return Err("a volfile needs at least one layer".into());
        }
        let mut idx = HashMap::new();
        for (i, l) in self.layers.iter().enumerate() {
            if l.name.is_empty() {
                return Err(format!("layer {i} has no name"));
            }
            if idx.insert(l.name.as_str(), i).is_some() {
                return Err(format!("two layers are named {:?}", l.name));
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            let kids = self.children_of(i, &idx)?;
            if l.kind.is_leaf() && !kids.is_empty() {
                return Err(format!(
                    "{} layer {:?} takes no subvolumes",
                    l.kind.type_name(),
                    l.name
                ));
            }
            if l.kind.is_cluster() {
                if kids.is_empty() {
                    return Err(format!(
                        "{} layer {:?} needs at least one subvolume",
                        l.kind.type_name(),
                        l.name
                    ));
                }
                if let LayerKind::Replicate {
                    quorum: Some(q), ..
                } = l.kind
                {
                    if q == 0 || q as usize > kids.len() {
                        return Err(format!(
                            "replicate layer {:?}: quorum {q} is not between 1 and its {} subvolumes",
                            l.name,
                            kids.len()
                        ));
                    }
                }
            } else if !l.kind.is_leaf() && kids.len() != 1 {
                return Err(format!(
                    "{} layer {:?} needs exactly one subvolume (it is the last layer, or names {})",
                    l.kind.type_name(),
                    l.name,
                    kids.len()
                ));
            }
        }
        // Walk from the top: no cycles, everything reached.
        let mut state = vec![0u8; self.layers.len()]; // 0 new, 1 on path, 2 done
        self.walk(0, &idx, &mut state)?;
        if let Some(i) = state.iter().position(|s| *s == 0) {
            return Err(format!(
                "layer {:?} is not below the top layer",
                self.layers[i].name
            ));
        }
        Ok(())
    }

    /// Each layer's position, by name.
    fn index(&self) -> HashMap<&str, usize> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| (l.name.as_str(), i))
            .collect()
    }

    /// The names of the layers below a replicate layer (at any depth).
    pub fn below_replicate(&self) -> std::collections::HashSet<String> {
        let idx = self.index();
        let mut below = std::collections::HashSet::new();
        let mut todo: Vec<usize> = (0..self.layers.len())
            .filter(|i| matches!(self.layers[*i].kind, LayerKind::Replicate { .. }))
            .flat_map(|i| self.children_of(i, &idx).unwrap_or_default())
            .collect();
        while let Some(i) = todo.pop() {
            if below.insert(self.layers[i].name.clone()) {
                todo.extend(self.children_of(i, &idx).unwrap_or_default());
            }
        }
        below
    }

    fn children_of(&self, i: usize, idx: &HashMap<&str, usize>) -> Result<Vec<usize>, String> {
        let l = &self.layers[i];
        if l.subvolumes.is_empty() {
            if l.kind.is_leaf() || i + 1 == self.layers.len() {
                return Ok(Vec::new());
            }
            return Ok(vec![i + 1]);
        }
        l.subvolumes
            .iter()
            .map(|s| {
                idx.get(s.as_str())
                    .copied()
                    .ok_or_else(|| format!("layer {:?} names unknown subvolume {s:?}", l.name))
            })
            .collect()
    }

    fn walk(&self, i: usize, idx: &HashMap<&str, usize>, state: &mut [u8]) -> Result<(), String> {
        match state[i] {
            1 => {
                return Err(format!(
                    "the graph has a cycle through {:?}",
                    self.layers[i].name
                ))
            }
            2 => return Ok(()),
            _ => {}
        }
        state[i] = 1;
        for c in self.children_of(i, idx)? {
            self.walk(c, idx, state)?;
        }
        state[i] = 2;
        Ok(())
    }

    /// Builds the stack and returns its top. `leaf` builds the types this crate does not know
    /// (given the definition and its built children); a layer used by two parents is built
    /// once.
    pub fn build(&self, leaf: &mut LeafBuilder<'_>) -> Result<LayerRef, String> {
        self.check()?;
        let idx = self.index();
        let mut built: Vec<Option<LayerRef>> = vec![None; self.layers.len()];
        self.build_at(0, &idx, &mut built, leaf)
    }

    fn build_at(
        &self,
        i: usize,
        idx: &HashMap<&str, usize>,
        built: &mut Vec<Option<LayerRef>>,
        leaf: &mut LeafBuilder<'_>,
    ) -> Result<LayerRef, String> {
        if let Some(l) = &built[i] {
            return Ok(l.clone());
        }
        let mut kids = Vec::new();
        for c in self.children_of(i, idx)? {
            kids.push(self.build_at(c, idx, built, leaf)?);
        }
        let def = &self.layers[i];
        let name = def.name.as_str();
        let layer: LayerRef = match &def.kind {
            LayerKind::IoStats {} => Arc::new(IoStats::new(name, kids.remove(0))),
            LayerKind::ErrorGen {
                fops,
                error,
                probability,
                seed,
            } => Arc::new(Fault::new(
                name,
                kids.remove(0),
                Trigger::new(fops, *probability, *seed).map_err(|e| format!("{name}: {e}"))?,
                Effect::Fail(parse_errno(error).map_err(|e| format!("{name}: {e}"))?),
            )),
            LayerKind::DelayGen {
                fops,
                delay_us,
                probability,
                seed,
            } => Arc::new(Fault::new(
                name,
                kids.remove(0),
                Trigger::new(fops, *probability, *seed).map_err(|e| format!("{name}: {e}"))?,
                Effect::Delay(Duration::from_micros(*delay_us)),
            )),
            LayerKind::Distribute { draining } => {
                let out: Vec<usize> = def
                    .subvolumes
                    .iter()
                    .enumerate()
                    .filter(|(_, n)| draining.contains(n))
                    .map(|(i, _)| i)
                    .collect();
                Arc::new(crate::distribute::Distribute::draining(name, kids, &out))
            }
            LayerKind::Shard { block_size } => {
                Arc::new(crate::shard::Shard::new(name, kids.remove(0), *block_size)?)
            }
            LayerKind::Replicate { quorum, timeout } => {
                let r = crate::replicate::Replicate::new(name, kids, *quorum);
                Arc::new(r.with_timeout(timeout.map(|s| Duration::from_secs(s.into()))))
            }
            _ => leaf(def, kids)?,
        };
        built[i] = Some(layer.clone());
        Ok(layer)
    }

    /// The stack of `layers` (top first) as a volfile, each with the next as its child.
    pub fn linear(layers: Vec<(String, LayerKind)>) -> Volfile {
        Volfile {
            layers: layers
                .into_iter()
                .map(|(name, kind)| LayerDef {
                    name,
                    subvolumes: Vec::new(),
                    kind,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"
[[layer]]
name = "top"
type = "io-stats"

[[layer]]
name = "slow"
type = "delay-gen"
fops = ["read"]
delay_us = 100

[[layer]]
name = "brick"
type = "protocol-client"
remote = "tcp:127.0.0.1:1"
"#;

    #[test]
    fn parses_and_round_trips() {
        let v = Volfile::parse(TWO).unwrap();
        assert_eq!(v.layers.len(), 3);
        assert_eq!(v.layers[1].kind.type_name(), "delay-gen");
        assert_eq!(Volfile::parse(&v.to_toml()).unwrap(), v);
    }

    #[test]
    fn refuses_bad_graphs_and_options() {
        let unknown_opt = TWO.replace("delay_us = 100", "delay_us = 100\ndelay_ms = 1");
        assert!(
            Volfile::parse(&unknown_opt).is_err(),
            "unknown option accepted"
        );
        let unknown_type = TWO.replace("\"io-stats\"", "\"io-stat\"");
        assert!(Volfile::parse(&unknown_type)
            .unwrap_err()
            .contains("io-stat"));
        let dup = TWO.replace("name = \"slow\"", "name = \"top\"");
        assert!(Volfile::parse(&dup).unwrap_err().contains("two layers"));
        let cycle = TWO.replace("name = \"slow\"", "name = \"slow\"\nsubvolumes = [\"top\"]");
        assert!(Volfile::parse(&cycle).unwrap_err().contains("cycle"));
        let missing = TWO.replace("name = \"slow\"", "name = \"slow\"\nsubvolumes = [\"x\"]");
        assert!(Volfile::parse(&missing)
            .unwrap_err()
            .contains("unknown subvolume"));
        let dangling = TWO.replace(
            "remote = \"tcp:127.0.0.1:1\"",
            "remote = \"x\"\n\n[[layer]]\nname = \"extra\"\ntype = \"io-stats\"",
        );
        assert!(Volfile::parse(&dangling).is_err());
        assert!(parse_errno("ENOSPC").is_ok() && parse_errno("EWHAT").is_err());
    }
}
