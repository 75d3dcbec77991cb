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
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use crate::config::{OptionDoc, Options, ProtocolClientConfig};
use crate::distribute::DistributeConfig;
use crate::faults::{DelayGenConfig, ErrorGenConfig, Fault};
use crate::iostats::IoStats;
use crate::layers::marks::MarksConfig;
use crate::layers::posix::PosixConfig;
use crate::replicate::ReplicateConfig;
use crate::shard::ShardConfig;
use crate::LayerRef;
use kiln_proto::Error;

/// Builds the layer types a side owns, given the definition and its built children.
pub type LeafBuilder<'b> = dyn FnMut(&LayerDef, Vec<LayerRef>) -> Result<LayerRef, Error> + 'b;

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

/// Layer types and their options (each type's options struct is declared with its layer;
/// see [`crate::config`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", deny_unknown_fields)]
pub enum LayerKind {
    /// Counts and times every fop (see [`crate::iostats`]).
    IoStats {},
    /// Fails chosen fops with an errno.
    ErrorGen(ErrorGenConfig),
    /// Delays chosen fops.
    DelayGen(DelayGenConfig),
    /// Brick storage: a directory on a local file system (brick side).
    Posix(PosixConfig),
    /// Runs fops that may block for long (fsync, fallocate, discard) on a thread pool and the
    /// rest inline (brick side).
    Dispatch {},
    /// Spreads files over its subvolumes by a hash of the name (client side).
    Distribute(DistributeConfig),
    /// Splits big files into pieces spread over the replica sets (client side; see
    /// [`crate::shard`]).
    Shard(ShardConfig),
    /// Keeps every file on all its subvolumes; writes need a quorum (client side).
    Replicate(ReplicateConfig),
    /// Per-file records of what replicas missed, and range locks for heal (brick side).
    Marks(MarksConfig),
    /// A connection to one brick (client side).
    ProtocolClient(ProtocolClientConfig),
}

impl LayerKind {
    /// The type's name as written in a volfile.
    pub fn type_name(&self) -> &'static str {
        match self {
            LayerKind::IoStats {} => "io-stats",
            LayerKind::ErrorGen(_) => "error-gen",
            LayerKind::DelayGen(_) => "delay-gen",
            LayerKind::Posix(_) => "posix",
            LayerKind::Dispatch {} => "dispatch",
            LayerKind::ProtocolClient(_) => "protocol-client",
            LayerKind::Distribute(_) => "distribute",
            LayerKind::Shard(_) => "shard",
            LayerKind::Replicate(_) => "replicate",
            LayerKind::Marks(_) => "marks",
        }
    }

    /// True for types that take several subvolumes.
    pub fn is_cluster(&self) -> bool {
        matches!(self, LayerKind::Distribute(_) | LayerKind::Replicate(_))
    }

    /// True for types at the bottom of a stack.
    pub fn is_leaf(&self) -> bool {
        matches!(self, LayerKind::Posix(_) | LayerKind::ProtocolClient(_))
    }
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
        options: ErrorGenConfig::DOCS,
    },
    TypeDoc {
        name: "delay-gen",
        side: "client, brick",
        doc: "holds matching fops back, holding the calling thread as a slow device would",
        options: DelayGenConfig::DOCS,
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
        options: PosixConfig::DOCS,
    },
    TypeDoc {
        name: "distribute",
        side: "client",
        doc: "spreads files over its subvolumes by a hash of the name, per-directory layouts; directories exist on every subvolume",
        options: DistributeConfig::DOCS,
    },
    TypeDoc {
        name: "shard",
        side: "client",
        doc: "stores files created from now on in pieces of block_size bytes striped over the replica sets (pieces in the hidden .shards directory); files made before stay whole",
        options: ShardConfig::DOCS,
    },
    TypeDoc {
        name: "replicate",
        side: "client",
        doc: "keeps every file on all subvolumes: changes go to all in parallel and need a quorum, misses are marked on the bricks and healed, reads go to one up-to-date replica",
        options: ReplicateConfig::DOCS,
    },
    TypeDoc {
        name: "marks",
        side: "brick",
        doc: "records, per file, the ranges other replicas missed (kept in the brick's .kiln directory) and holds writes back from ranges a heal has locked",
        options: MarksConfig::DOCS,
    },
    TypeDoc {
        name: "protocol-client",
        side: "client (leaf)",
        doc: "one connection to a brick; many requests in flight, replies received into the caller's memory",
        options: ProtocolClientConfig::DOCS,
    },
];

/// The documented layer type named `name`.
pub fn type_doc(name: &str) -> Option<&'static TypeDoc> {
    TYPES.iter().find(|t| t.name == name)
}

impl LayerKind {
    /// Sets the option `field` to `value`, as the line `field = value` in the layer's volfile
    /// table would; an option the type does not have, or a value of the wrong type, is an
    /// error.
    pub fn set_option(&mut self, field: &str, value: toml::Value) -> Result<(), Error> {
        let ty = self.type_name();
        let mut table = match toml::Value::try_from(&*self) {
            Ok(toml::Value::Table(t)) => t,
            other => {
                return Err(Error::invalid(format!(
                    "{ty} layer: not a table ({other:?})"
                )))
            }
        };
        table.insert(field.to_owned(), value);
        *self = toml::Value::Table(table)
            .try_into()
            .map_err(|e| Error::invalid(format!("{ty} option {field}: {e}")))?;
        Ok(())
    }
}

impl Volfile {
    /// Parses and checks a volfile.
    pub fn parse(text: &str) -> Result<Volfile, Error> {
        let v: Volfile =
            toml::from_str(text).map_err(|e| Error::invalid(format!("bad volfile: {e}")))?;
        v.check()?;
        Ok(v)
    }

    /// Reads and parses a volfile.
    pub fn load(path: &std::path::Path) -> Result<Volfile, Error> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::io(format_args!("cannot read volfile {}", path.display()), &e))?;
        Volfile::parse(&text).map_err(|e| e.context(path.display()))
    }

    /// The volfile as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a volfile always serialises")
    }

    /// Names are unique, subvolumes exist, leaves have none, the graph has no cycles and every
    /// layer is reachable from the top.
    pub fn check(&self) -> Result<(), Error> {
        if self.layers.is_empty() {
            return Err(Error::invalid("a volfile needs at least one layer"));
        }
        let mut idx = HashMap::new();
        for (i, l) in self.layers.iter().enumerate() {
            if l.name.is_empty() {
                return Err(Error::invalid(format!("layer {i} has no name")));
            }
            if idx.insert(l.name.as_str(), i).is_some() {
                return Err(Error::invalid(format!("two layers are named {:?}", l.name)));
            }
        }
        for (i, l) in self.layers.iter().enumerate() {
            let kids = self.children_of(i, &idx)?;
            if l.kind.is_leaf() && !kids.is_empty() {
                return Err(Error::invalid(format!(
                    "{} layer {:?} takes no subvolumes",
                    l.kind.type_name(),
                    l.name
                )));
            }
            if l.kind.is_cluster() {
                if kids.is_empty() {
                    return Err(Error::invalid(format!(
                        "{} layer {:?} needs at least one subvolume",
                        l.kind.type_name(),
                        l.name
                    )));
                }
                if let LayerKind::Replicate(ReplicateConfig {
                    quorum: Some(q), ..
                }) = l.kind
                {
                    if q == 0 || q as usize > kids.len() {
                        return Err(Error::invalid(format!(
                            "replicate layer {:?}: quorum {q} is not between 1 and its {} subvolumes",
                            l.name,
                            kids.len()
                        )));
                    }
                }
            } else if !l.kind.is_leaf() && kids.len() != 1 {
                return Err(Error::invalid(format!(
                    "{} layer {:?} needs exactly one subvolume (it is the last layer, or names {})",
                    l.kind.type_name(),
                    l.name,
                    kids.len()
                )));
            }
        }
        // Walk from the top: no cycles, everything reached.
        let mut state = vec![0u8; self.layers.len()]; // 0 new, 1 on path, 2 done
        self.walk(0, &idx, &mut state)?;
        if let Some(i) = state.iter().position(|s| *s == 0) {
            return Err(Error::invalid(format!(
                "layer {:?} is not below the top layer",
                self.layers[i].name
            )));
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
            .filter(|i| matches!(self.layers[*i].kind, LayerKind::Replicate(_)))
            .flat_map(|i| self.children_of(i, &idx).unwrap_or_default())
            .collect();
        while let Some(i) = todo.pop() {
            if below.insert(self.layers[i].name.clone()) {
                todo.extend(self.children_of(i, &idx).unwrap_or_default());
            }
        }
        below
    }

    fn children_of(&self, i: usize, idx: &HashMap<&str, usize>) -> Result<Vec<usize>, Error> {
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
                idx.get(s.as_str()).copied().ok_or_else(|| {
                    Error::invalid(format!("layer {:?} names unknown subvolume {s:?}", l.name))
                })
            })
            .collect()
    }

    fn walk(&self, i: usize, idx: &HashMap<&str, usize>, state: &mut [u8]) -> Result<(), Error> {
        match state[i] {
            1 => {
                return Err(Error::invalid(format!(
                    "the graph has a cycle through {:?}",
                    self.layers[i].name
                )))
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
    pub fn build(&self, leaf: &mut LeafBuilder<'_>) -> Result<LayerRef, Error> {
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
    ) -> Result<LayerRef, Error> {
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
            LayerKind::ErrorGen(c) => Arc::new(Fault::error_gen(name, kids.remove(0), c)?),
            LayerKind::DelayGen(c) => Arc::new(Fault::delay_gen(name, kids.remove(0), c)?),
            // Shard's pieces are placed alike by every graph of a volume, with a shard layer
            // above this one or not (heal's and rebalance's graphs have none): a piece's name
            // cannot be anything else's.
            LayerKind::Distribute(c) => Arc::new(
                crate::distribute::Distribute::configured(name, kids, &def.subvolumes, c)
                    .with_placement(Arc::new(crate::shard::Pieces)),
            ),
            LayerKind::Shard(c) => Arc::new(crate::shard::Shard::new(
                name,
                kids.remove(0),
                c.block_size,
            )?),
            LayerKind::Replicate(c) => {
                Arc::new(crate::replicate::Replicate::configured(name, kids, c))
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
            .message()
            .contains("io-stat"));
        let dup = TWO.replace("name = \"slow\"", "name = \"top\"");
        assert!(Volfile::parse(&dup)
            .unwrap_err()
            .message()
            .contains("two layers"));
        let cycle = TWO.replace("name = \"slow\"", "name = \"slow\"\nsubvolumes = [\"top\"]");
        assert!(Volfile::parse(&cycle)
            .unwrap_err()
            .message()
            .contains("cycle"));
        let missing = TWO.replace("name = \"slow\"", "name = \"slow\"\nsubvolumes = [\"x\"]");
        assert!(Volfile::parse(&missing)
            .unwrap_err()
            .message()
            .contains("unknown subvolume"));
        let dangling = TWO.replace(
            "remote = \"tcp:127.0.0.1:1\"",
            "remote = \"x\"\n\n[[layer]]\nname = \"extra\"\ntype = \"io-stats\"",
        );
        assert!(Volfile::parse(&dangling).is_err());
        assert!(
            crate::faults::parse_errno("ENOSPC").is_ok()
                && crate::faults::parse_errno("EWHAT").is_err()
        );
    }
}
