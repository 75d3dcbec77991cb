//! The volume options: one table — name, type, default, what it does, whether bricks restart
//! to take it — that `kiln volume set|get|reset` and the README read, and the one parser of
//! their values.

use serde::{Deserialize, Serialize};

use kiln_layer::volfile::Volfile;

use crate::def::VolumeDef;
use crate::request::Request;
use kiln_proto::Error;

/// One option as `volume get` shows it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct OptionValue {
    /// Its name.
    pub name: String,
    /// Its value now.
    pub value: String,
    /// Its value when never set.
    pub default: String,
    /// What values it takes.
    #[serde(rename = "type")]
    pub kind: String,
    /// Whether a started volume's bricks restart to take a new value.
    pub restarts_bricks: bool,
    /// What it does.
    pub description: String,
}

/// Where an option's value goes.
pub enum Target {
    /// kilnd reads it from the definition itself (the bricks' allow-list, identities, the
    /// graph's shape): `get` and `set` are its field's.
    Definition {
        /// Its value in a definition.
        get: fn(&VolumeDef) -> String,
        /// Stores the value `text` in a definition; `Err(None)`: not one of [`Spec::kind`],
        /// `Err(Some(why))`: of the kind but refused.
        set: fn(&mut VolumeDef, &str) -> Result<(), Option<String>>,
    },
    /// The option `field` of every layer of type `layer` in the volume's graphs (a field of
    /// the type's options struct, see `kiln_layer::config`). The value is kept by name in
    /// [`VolumeDef::options`] when not the default; nothing else names it.
    Layer {
        /// The layer type (`posix`, `protocol-client`, …).
        layer: &'static str,
        /// The field of its options.
        field: &'static str,
        /// The value `text` as the layer takes it; errors as [`Target::Definition`]'s `set`.
        value: fn(&str) -> Result<toml::Value, Option<String>>,
        /// A value as `volume get` shows it (and the definition keeps it): `show_on_off`,
        /// `show_number` or `show_size`.
        show: fn(&toml::Value) -> String,
    },
}

/// An option of the table.
pub struct Spec {
    /// Its name.
    pub name: &'static str,
    /// What values it takes.
    pub kind: &'static str,
    /// Its value when never set.
    pub default: &'static str,
    /// Whether a started volume's bricks restart to take a new value (else running clients
    /// take it with their next graph, within a second).
    pub restarts_bricks: bool,
    /// What it does.
    pub description: &'static str,
    /// Where its value goes.
    pub target: Target,
    /// Chosen at create only: `set` refuses it, `reset all` leaves it.
    pub create_only: bool,
}

/// Every volume option.
pub const OPTIONS: &[Spec] = &[
    Spec {
        name: "allow",
        kind: "address ranges (ADDR/PREFIX,…), or all to take clients from anywhere",
        default: "all",
        restarts_bricks: true,
        description: "the clients the bricks take connections from; others are refused and logged",
        target: Target::Definition {
            get: |d| {
                if d.allow.is_empty() {
                    "all".into()
                } else {
                    d.allow.join(",")
                }
            },
            set: |d, text| {
                d.allow = parse_allow(text).map_err(|e| Some(e.to_string()))?;
                Ok(())
            },
        },
        create_only: false,
    },
    Spec {
        name: "root-squash",
        kind: "on or off",
        default: "off",
        restarts_bricks: true,
        description: "clients' root acts as nobody on the bricks (like NFS root_squash)",
        target: Target::Definition {
            get: |d| if d.root_squash { "on" } else { "off" }.into(),
            set: |d, text| {
                d.root_squash = on_off(text)?;
                Ok(())
            },
        },
        create_only: false,
    },
    Spec {
        name: "io-timeout",
        kind: "seconds, 0 to 86400",
        default: "30",
        restarts_bricks: false,
        description: "how long a client's I/O waits for bricks that are away before it fails \
                      with ENOTCONN (like an NFS hard mount's patience)",
        target: Target::Definition {
            get: |d| d.io_timeout.unwrap_or(30).to_string(),
            set: |d, text| {
                d.io_timeout = Some(number(text, 0..=86_400)?);
                Ok(())
            },
        },
        create_only: false,
    },
    Spec {
        name: "ping-timeout",
        kind: "milliseconds, 200 to 60000, or 0 for never",
        default: "1200",
        restarts_bricks: false,
        description: "how long a client waits with requests outstanding and not a byte from a \
                      brick, its host acknowledging nothing either, before it takes the brick \
                      for away and goes on with the other replicas (a brick that answers but \
                      is stuck: eight times this)",
        target: Target::Layer {
            layer: "protocol-client",
            field: "ping_timeout",
            value: |text| {
                let ms = number(text, 0..=u32::MAX)?;
                if ms != 0 && !(200..=60_000).contains(&ms) {
                    return Err(Some(format!(
                        "ping-timeout takes 0 (never) or 200 to 60000 milliseconds, not {text}: \
                         shorter takes a busy host for a lost one"
                    )));
                }
                Ok(toml::Value::Integer(ms.into()))
            },
            show: show_number,
        },
        create_only: false,
    },
    Spec {
        name: "short-circuit",
        kind: "on or off",
        default: "on",
        restarts_bricks: false,
        description: "clients on a brick's host read straight from the brick's files (a \
                      descriptor the brick passes over its Unix socket) while the brick \
                      vouches that nothing changed them; writes always go through the brick",
        target: Target::Layer {
            layer: "protocol-client",
            field: "short_circuit",
            value: |text| Ok(toml::Value::Boolean(on_off(text)?)),
            show: show_on_off,
        },
        create_only: false,
    },
    Spec {
        name: "flush-behind",
        kind: "a size of at least 1M (e.g. 8M), or 0 for off",
        default: "0",
        restarts_bricks: true,
        description: "the bricks write a file's dirty pages back after every this many bytes \
                      written through one open file, so a snapshot (reflink) or a guest's \
                      flush waits for about three times this per writer at most, for about \
                      15% of write speed; 0 (the default) leaves write-back to the kernel \
                      (faster writes, waits of seconds for a snapshot under steady writes)",
        target: Target::Layer {
            layer: "posix",
            field: "flush_behind",
            value: |text| {
                let w = parse_size(text).map_err(|_| None)?;
                // A window under 1 MiB would have nearly every write wait for a whole-file
                // write-back.
                if w != 0 && w < 1 << 20 {
                    return Err(Some(format!(
                        "flush-behind takes 0 (off) or at least 1M, not {text:?}"
                    )));
                }
                let w = i64::try_from(w).map_err(|_| Some(format!("{text}: too big")))?;
                Ok(toml::Value::Integer(w))
            },
            show: show_size,
        },
        create_only: false,
    },
    Spec {
        name: "sync-writes",
        kind: "on or off",
        default: "off",
        restarts_bricks: true,
        description: "every write the bricks take is on stable storage before it is answered \
                      (files opened for writing with O_DSYNC), for clients that never flush; \
                      costs write speed, most on disks whose cache is slow to flush",
        target: Target::Layer {
            layer: "posix",
            field: "sync_writes",
            value: |text| Ok(toml::Value::Boolean(on_off(text)?)),
            show: show_on_off,
        },
        create_only: false,
    },
    Spec {
        name: "shared-secret",
        kind: "on or off",
        default: "off",
        restarts_bricks: true,
        description: "clients may prove the volume's shared secret (the compatibility \
                      identity; on for volumes made before identities); off: only identities \
                      made with `kiln auth`, clients on the pool's hosts and kilnd's own",
        target: Target::Definition {
            get: |d| {
                if d.shared_secret == Some(false) {
                    "off"
                } else {
                    "on"
                }
                .into()
            },
            set: |d, text| {
                d.shared_secret = Some(on_off(text)?);
                Ok(())
            },
        },
        create_only: false,
    },
    Spec {
        name: "shard-block-size",
        kind: "chosen at create (--shard SIZE): a power of two from 1M to 1T, or off",
        default: "off",
        restarts_bricks: false,
        description: "files are stored in pieces of this size striped over the replica sets, \
                      so one big image uses them all; off: each file whole on one set",
        target: Target::Definition {
            get: |d| d.shard_block.map_or("off".into(), size_text),
            set: |_, _| {
                Err(Some(
                    "shard-block-size is chosen when the volume is created (kiln volume create \
                     --shard SIZE): the pieces of files already written depend on it"
                        .into(),
                ))
            },
        },
        create_only: true,
    },
];

/// The README's table of volume options (between `<!-- volume-options -->` and
/// `<!-- /volume-options -->`; a test keeps it equal to this).
pub fn markdown_table() -> String {
    let mut out = String::from(
        "| option | type | default | bricks restart | what it does |\n|---|---|---|---|---|\n",
    );
    for s in OPTIONS {
        let restart = match (s.create_only, s.restarts_bricks) {
            (true, _) => "—",
            (false, true) => "yes",
            (false, false) => "no (running clients switch within a second)",
        };
        let one_line = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
        out.push_str(&format!(
            "| `{}` | {} | `{}` | {restart} | {} |\n",
            s.name,
            one_line(s.kind),
            s.default,
            one_line(s.description)
        ));
    }
    out
}

/// `bytes` as `volume get` shows a size: the largest unit (K, M, G, T) it is a whole number of.
pub fn size_text(bytes: u64) -> String {
    for (unit, shift) in [("T", 40), ("G", 30), ("M", 20), ("K", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// A size written as `volume create --shard` takes it: bytes, or a number with K, M, G or T
/// (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, Error> {
    let (num, shift) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => {
                    return Err(Error::invalid(format!(
                        "{text:?}: unknown unit {c:?} (want K, M, G or T)"
                    )))
                }
            };
            (&text[..i], shift)
        }
        _ => (text, 0),
    };
    digits(num)
        .then(|| num.parse::<u64>().ok())
        .flatten()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| Error::invalid(format!("{text:?} is not a size (e.g. 64M)")))
}

/// The option named `name`, or an error listing the options.
pub fn spec(name: &str) -> Result<&'static Spec, Error> {
    OPTIONS.iter().find(|s| s.name == name).ok_or_else(|| {
        let names: Vec<&str> = OPTIONS.iter().map(|s| s.name).collect();
        Error::invalid(format!(
            "no volume option {name:?} (options: {})",
            names.join(", ")
        ))
    })
}

/// True when `text` is one or more ASCII digits and nothing else (`str::parse` would take a
/// leading `+` too).
fn digits(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())
}

/// The value of `allow`: exactly `all` (an empty list: clients from anywhere), or address
/// ranges separated by commas, spaces around each allowed. An empty item (`,,,`, a trailing
/// comma, a value of spaces) is refused: it must never read as "allow everyone".
pub(crate) fn parse_allow(text: &str) -> Result<Vec<String>, Error> {
    if text == "all" {
        return Ok(Vec::new());
    }
    let ranges: Vec<String> = text.split(',').map(|c| c.trim().to_owned()).collect();
    if ranges.iter().any(String::is_empty) {
        return Err(Error::failed(format!(
            "allow {text:?} has an empty address range: give ranges separated by single \
             commas (10.0.0.0/24,192.168.1.7), or `all` to take clients from anywhere"
        )));
    }
    check_allow(&ranges)
}

/// An `allow` list: address ranges (ADDR/PREFIX), each checked.
pub(crate) fn check_allow(allow: &[String]) -> Result<Vec<String>, Error> {
    for c in allow {
        // The address parser takes a prefix of "+8"; a range is written without signs.
        if c.contains('+') {
            return Err(Error::invalid(format!(
                "allow {c:?}: not an address range (want e.g. 10.0.0.0/8)"
            )));
        }
        c.parse::<kiln_server::access::Cidr>()
            .map_err(|e| Error::invalid(format!("allow {c:?}: {e}")))?;
    }
    Ok(allow.to_vec())
}

/// A switch as `volume get` shows it.
fn show_on_off(v: &toml::Value) -> String {
    match v.as_bool() {
        Some(true) => "on".into(),
        Some(false) => "off".into(),
        None => v.to_string(),
    }
}

/// A number as `volume get` shows it.
fn show_number(v: &toml::Value) -> String {
    v.to_string()
}

/// A size in bytes as `volume get` shows it (`64M`).
fn show_size(v: &toml::Value) -> String {
    match v.as_integer().and_then(|n| u64::try_from(n).ok()) {
        Some(n) => size_text(n),
        None => v.to_string(),
    }
}

/// A whole number of `range`, written as digits only.
fn number(text: &str, range: std::ops::RangeInclusive<u32>) -> Result<u32, Option<String>> {
    digits(text)
        .then(|| text.parse::<u32>().ok())
        .flatten()
        .filter(|n| range.contains(n))
        .ok_or(None)
}

/// "on" or "off".
fn on_off(text: &str) -> Result<bool, Option<String>> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(None),
    }
}

/// Gives `def` the option `name` the value `text`; returns whether a started volume's bricks
/// restart to take it.
pub fn apply(def: &mut VolumeDef, name: &str, text: &str) -> Result<bool, Error> {
    let s = spec(name)?;
    let refused = |why: Option<String>| {
        Error::invalid(why.unwrap_or_else(|| format!("{name} takes {}, not {text:?}", s.kind)))
    };
    match &s.target {
        Target::Definition { set, .. } => set(def, text).map_err(refused)?,
        Target::Layer { value, show, .. } => {
            let v = value(text).map_err(refused)?;
            forget_legacy(def, s.name);
            // The default is kept as nothing: the graph stays as it was.
            if value(s.default).ok().as_ref() == Some(&v) {
                def.options.remove(s.name);
            } else {
                def.options.insert(s.name.to_owned(), show(&v));
            }
        }
    }
    Ok(s.restarts_bricks)
}

/// The value of option `s` in `def` as `volume get` shows it.
fn value_text(s: &Spec, def: &VolumeDef) -> String {
    match &s.target {
        Target::Definition { get, .. } => get(def),
        Target::Layer { show, .. } => match layer_value(s, def) {
            Ok(Some(v)) => show(&v),
            Ok(None) => s.default.to_owned(),
            // Shown as stored; building a graph says what is wrong with it.
            Err(_) => def.options.get(s.name).cloned().unwrap_or_default(),
        },
    }
}

/// The value of layer option `s` in `def` as its layer takes it, when set: kept by name
/// (checked again), or in a field of a definition stored before (taken as it was).
fn layer_value(s: &Spec, def: &VolumeDef) -> Result<Option<toml::Value>, Error> {
    let Target::Layer { value, .. } = &s.target else {
        return Ok(None);
    };
    match def.options.get(s.name) {
        Some(text) => value(text).map(Some).map_err(|why| {
            Error::failed(format!(
                "volume {}: stored {} {text:?} is not valid{}",
                def.name,
                s.name,
                why.map(|w| format!(": {w}")).unwrap_or_default()
            ))
        }),
        None => Ok(legacy(def, s.name)),
    }
}

/// The value of layer option `name` from a field of a definition stored before
/// [`VolumeDef::options`], if it has one, as that kilnd put it in its graphs.
fn legacy(def: &VolumeDef, name: &str) -> Option<toml::Value> {
    match name {
        "ping-timeout" => def.ping_timeout.map(|v| toml::Value::Integer(v.into())),
        "short-circuit" => def.short_circuit.map(toml::Value::Boolean),
        "flush-behind" => def
            .flush_behind
            .and_then(|v| i64::try_from(v).ok())
            .map(toml::Value::Integer),
        _ => None,
    }
}

/// Drops the legacy field of layer option `name` (it is being set by name).
fn forget_legacy(def: &mut VolumeDef, name: &str) {
    match name {
        "ping-timeout" => def.ping_timeout = None,
        "short-circuit" => def.short_circuit = None,
        "flush-behind" => def.flush_behind = None,
        _ => {}
    }
}

/// Gives the layers of `volfile` (a graph of volume `def`) the options of `def` that configure
/// their types ([`Target::Layer`]). An option this kilnd does not know (set by a newer one)
/// is an error, not left out: every kilnd of a pool is upgraded before such options are set.
pub fn configure(def: &VolumeDef, volfile: &mut Volfile) -> Result<(), Error> {
    if let Some(name) = def.options.keys().find(|n| spec(n).is_err()) {
        return Err(Error::failed(format!(
            "volume {}: option {name:?} is not known to this kilnd (set by a newer one?): \
             upgrade it before the volume's graphs can be made here",
            def.name
        )));
    }
    for s in OPTIONS {
        let (Target::Layer { layer, field, .. }, Some(v)) = (&s.target, layer_value(s, def)?)
        else {
            continue;
        };
        for l in volfile
            .layers
            .iter_mut()
            .filter(|l| l.kind.type_name() == *layer)
        {
            l.kind.set_option(field, v.clone())?;
        }
    }
    Ok(())
}

/// The `set` request that gives volume `volume` the option `name` the value `text` (checked
/// here, so a bad value is refused before a server is asked).
pub fn set_request(volume: &str, name: &str, text: &str) -> Result<Request, Error> {
    apply(&mut VolumeDef::default(), name, text)?;
    Ok(Request::Set {
        name: volume.to_owned(),
        options: vec![(name.to_owned(), text.to_owned())],
    })
}

/// The one `set` request that gives volume `volume` the defaults of the options `names`.
pub fn reset_request(volume: &str, names: &[&str]) -> Result<Request, Error> {
    let options = names
        .iter()
        .map(|n| Ok((spec(n)?.name.to_owned(), spec(n)?.default.to_owned())))
        .collect::<Result<_, Error>>()?;
    Ok(Request::Set {
        name: volume.to_owned(),
        options,
    })
}

/// The options of `def` (`name`, or all of them) as `volume get` shows them.
pub fn values(def: &VolumeDef, name: Option<&str>) -> Result<Vec<OptionValue>, Error> {
    let specs: Vec<&Spec> = match name {
        None | Some("all") => OPTIONS.iter().collect(),
        Some(n) => vec![spec(n)?],
    };
    Ok(specs
        .into_iter()
        .map(|s| OptionValue {
            name: s.name.into(),
            value: value_text(s, def),
            default: s.default.into(),
            kind: s.kind.into(),
            restarts_bricks: s.restarts_bricks,
            description: s.description.into(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_option_sets_and_reads_back_and_its_default_is_what_a_new_volume_has() {
        let fresh = crate::tests::def(1, 1);
        for s in OPTIONS {
            assert_eq!(value_text(s, &fresh), s.default, "{}", s.name);
        }
        let mut d = fresh.clone();
        for (name, text) in [
            ("allow", "10.0.0.0/8,127.0.0.1/32"),
            ("root-squash", "on"),
            ("io-timeout", "7"),
            ("ping-timeout", "3000"),
            ("short-circuit", "off"),
            ("flush-behind", "64M"),
        ] {
            assert!(set_request("v", name, text).is_ok());
            apply(&mut d, name, text).unwrap();
            assert_eq!(values(&d, Some(name)).unwrap()[0].value, text);
        }
        assert!(set_request("v", "io-timeout", "86401").is_err());
        // A ping timeout so short that a busy host would be taken for a lost one is refused,
        // saying why; 0 is "never", and the default is stored as nothing.
        for (text, ok) in [
            ("199", false),
            ("60001", false),
            ("1.5", false),
            ("0", true),
        ] {
            let mut p = fresh.clone();
            let r = apply(&mut p, "ping-timeout", text);
            assert_eq!(r.is_ok(), ok, "{text}: {r:?}");
        }
        let e = apply(&mut fresh.clone(), "ping-timeout", "100").unwrap_err();
        assert!(
            e.message().contains("200 to 60000") && e.message().contains("busy host"),
            "{e}"
        );
        let mut p = fresh.clone();
        apply(&mut p, "ping-timeout", "1200").unwrap();
        assert_eq!(p.options.get("ping-timeout"), None);
        assert_eq!(d.options["ping-timeout"], "3000");
        for bad in [
            "",
            ",,,",
            " ",
            "10.0.0.0/8,",
            ",10.0.0.0/8",
            "10.0.0.0/8,,127.0.0.1",
            "all,",
        ] {
            let e = set_request("v", "allow", bad).unwrap_err();
            assert!(e.message().contains("allow"), "{bad:?}: {e}");
        }
        assert!(set_request("v", "allow", "10.0.0.0/+8").is_err());
        assert_eq!(
            parse_allow("10.0.0.0/8, 127.0.0.1/32"),
            Ok(vec!["10.0.0.0/8".into(), "127.0.0.1/32".into()])
        );
        for bad in ["", " 7", "7 ", "+7", "-1", "7.5", "0x10"] {
            assert!(set_request("v", "io-timeout", bad).is_err(), "{bad:?}");
        }
        for bad in ["", " 8M", "8M ", "+8M", "8 M", "on", "ON"] {
            assert!(set_request("v", "flush-behind", bad).is_err(), "{bad:?}");
        }
        for bad in ["", "On", " on", "1", "true", "yes"] {
            assert!(set_request("v", "root-squash", bad).is_err(), "{bad:?}");
            assert!(set_request("v", "short-circuit", bad).is_err(), "{bad:?}");
        }
        assert!(set_request("v", "allow", "10.0.0.0/33")
            .unwrap_err()
            .message()
            .contains("10.0.0.0/33"));
        let mut reset = d.clone();
        let Request::Set { options, .. } = reset_request(
            "v",
            &[
                "allow",
                "root-squash",
                "io-timeout",
                "ping-timeout",
                "short-circuit",
                "flush-behind",
            ],
        )
        .unwrap() else {
            panic!("a set request");
        };
        for (n, t) in options {
            apply(&mut reset, &n, &t).unwrap();
        }
        let mut expect = fresh.clone();
        expect.io_timeout = Some(30);
        assert_eq!(reset, expect, "reset gives every option its default");
        assert!(set_request("v", "flush-behind", "4K").is_err());
        assert!(set_request("v", "flush-behind", "0").is_ok());
        assert!(set_request("v", "root-squash", "yes")
            .unwrap_err()
            .message()
            .contains("on or off"));
        assert!(spec("nope").err().unwrap().message().contains("io-timeout"));
        assert!(set_request("v", "shard-block-size", "4M")
            .unwrap_err()
            .message()
            .contains("--shard"));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1t"), Ok(1 << 40));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("4X").is_err() && parse_size("M").is_err() && parse_size("").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(size_text(64 << 20), "64M");
        assert_eq!(size_text(3 << 30), "3G");
        assert_eq!(size_text(1000), "1000");
        assert_eq!(values(&d, Some("all")).unwrap().len(), OPTIONS.len());
    }

    #[test]
    fn the_readme_table_is_the_options_table() {
        // KILN_BLESS=1 cargo test -p kiln-mgmt readme rewrites it.
        let path = std::path::PathBuf::from(
            std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo test sets CARGO_MANIFEST_DIR"),
        )
        .join("../../README.md");
        let readme = std::fs::read_to_string(&path).unwrap();
        let (begin, end) = ("<!-- volume-options -->\n", "<!-- /volume-options -->");
        let a = readme
            .find(begin)
            .expect("README has the options table's marks")
            + begin.len();
        let b = a + readme[a..].find(end).expect("the table's end mark");
        let want = markdown_table();
        if readme[a..b] != want {
            if std::env::var_os("KILN_BLESS").is_some() {
                let new = format!("{}{want}{}", &readme[..a], &readme[b..]);
                std::fs::write(&path, new).unwrap();
            } else {
                panic!(
                    "README.md's volume options differ from crates/mgmt/src/options.rs; \
                     KILN_BLESS=1 cargo test -p kiln-mgmt readme rewrites them. Want:\n{want}"
                );
            }
        }
    }

    #[test]
    fn every_layer_option_names_a_field_its_layer_has_and_takes_its_default() {
        for s in OPTIONS {
            let Target::Layer {
                layer,
                field,
                value,
                ..
            } = &s.target
            else {
                continue;
            };
            let t = kiln_layer::volfile::type_doc(layer)
                .unwrap_or_else(|| panic!("{}: no layer type {layer:?}", s.name));
            let o = t.options.iter().find(|o| o.name == *field);
            let o = o.unwrap_or_else(|| panic!("{}: {layer} has no option {field:?}", s.name));
            // The row's default is the layer's: else `set X DEFAULT` (kept as nothing, so the
            // layer's default) would not give what `volume get` shows.
            let layers: toml::Table = toml::from_str(&format!("v = {}", o.default))
                .unwrap_or_else(|e| panic!("{layer}.{field} default {:?}: {e}", o.default));
            assert_eq!(
                value(s.default).ok().as_ref(),
                layers.get("v"),
                "{}: the table's default {} is not {layer}'s {}",
                s.name,
                s.default,
                o.default
            );
            // A brick's graph is read when the brick starts; a client's, whenever it changes.
            assert_eq!(
                s.restarts_bricks,
                t.side.starts_with("brick"),
                "{}: bricks restart for an option of a {} layer",
                s.name,
                t.side
            );
        }
    }

    #[test]
    fn layer_options_reach_the_graphs_and_definitions_stored_before_keep_theirs() {
        let mut d = crate::tests::def(3, 3);
        let graph = |d: &VolumeDef| crate::client_volfile(d).unwrap().to_toml();
        let brick = |d: &VolumeDef| {
            crate::brick_volfile(d, 0, std::path::Path::new("/b0"))
                .unwrap()
                .to_toml()
        };
        let (g0, b0) = (graph(&d), brick(&d));
        assert!(!g0.contains("ping_timeout") && !b0.contains("flush_behind"));
        apply(&mut d, "ping-timeout", "3000").unwrap();
        apply(&mut d, "flush-behind", "8M").unwrap();
        apply(&mut d, "short-circuit", "off").unwrap();
        let g = graph(&d);
        assert_eq!(g.matches("ping_timeout = 3000").count(), 3, "{g}");
        assert_eq!(g.matches("short_circuit = false").count(), 3, "{g}");
        assert!(
            brick(&d).contains("flush_behind = 8388608"),
            "{}",
            brick(&d)
        );
        // Back to the defaults: the graphs are as they were.
        for n in ["ping-timeout", "flush-behind", "short-circuit"] {
            apply(&mut d, n, spec(n).unwrap().default).unwrap();
        }
        assert!(d.options.is_empty());
        assert_eq!((graph(&d), brick(&d)), (g0, b0));
        // A definition stored with the fields of before: shown, in the graph, and moved
        // into the options by the next set.
        let mut old = crate::tests::def(3, 3);
        old.ping_timeout = Some(5000);
        old.flush_behind = Some(16 << 20);
        assert_eq!(values(&old, Some("ping-timeout")).unwrap()[0].value, "5000");
        assert_eq!(values(&old, Some("flush-behind")).unwrap()[0].value, "16M");
        assert_eq!(graph(&old).matches("ping_timeout = 5000").count(), 3);
        assert!(brick(&old).contains("flush_behind = 16777216"));
        apply(&mut old, "ping-timeout", "0").unwrap();
        assert_eq!(old.ping_timeout, None);
        assert_eq!(graph(&old).matches("ping_timeout = 0").count(), 3);
        // A field stored by a kilnd that took any size is used as it was...
        old.flush_behind = Some(4096);
        assert!(brick(&old).contains("flush_behind = 4096"));
        // ...but a value kept by name that no longer parses is an error naming it, not a
        // default; so is a name this kilnd does not know.
        old.options.insert("flush-behind".into(), "4K".into());
        let e = crate::brick_volfile(&old, 0, std::path::Path::new("/b0")).unwrap_err();
        assert!(
            e.message().contains("flush-behind") && e.message().contains("4K"),
            "{e}"
        );
        let mut newer = crate::tests::def(3, 3);
        newer.options.insert("from-the-future".into(), "on".into());
        let e = crate::client_volfile(&newer).unwrap_err();
        assert!(
            e.message().contains("from-the-future") && e.message().contains("upgrade"),
            "{e}"
        );
        // Values are kept and shown in one spelling.
        apply(&mut d, "flush-behind", "67108864").unwrap();
        apply(&mut d, "ping-timeout", "03000").unwrap();
        assert_eq!(d.options["flush-behind"], "64M");
        assert_eq!(values(&d, Some("ping-timeout")).unwrap()[0].value, "3000");
    }
}
