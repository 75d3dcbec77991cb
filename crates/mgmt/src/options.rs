//! The volume options: one table — name, type, default, what it does, whether bricks restart
//! to take it — that `kiln volume set|get|reset` and the README read, and the one parser of
//! their values.

use serde::{Deserialize, Serialize};

use crate::def::VolumeDef;
use crate::request::Request;

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

/// An option of the table.
pub struct Spec {
    /// Its name.
    pub name: &'static str,
    /// What values it takes.
    pub kind: &'static str,
    /// Its value when never set.
    pub default: &'static str,
    /// Whether a started volume's bricks restart to take a new value.
    pub restarts_bricks: bool,
    /// What it does.
    pub description: &'static str,
    /// Its value in a definition.
    pub get: fn(&VolumeDef) -> String,
    /// Stores the value `text` in a definition; `Err(None)`: not one of [`Spec::kind`],
    /// `Err(Some(why))`: of the kind but refused.
    pub set: fn(&mut VolumeDef, &str) -> Result<(), Option<String>>,
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
        get: |d| {
            if d.allow.is_empty() {
                "all".into()
            } else {
                d.allow.join(",")
            }
        },
        set: |d, text| {
            d.allow = parse_allow(text).map_err(Some)?;
            Ok(())
        },
        create_only: false,
    },
    Spec {
        name: "root-squash",
        kind: "on or off",
        default: "off",
        restarts_bricks: true,
        description: "clients' root acts as nobody on the bricks (like NFS root_squash)",
        get: |d| if d.root_squash { "on" } else { "off" }.into(),
        set: |d, text| {
            d.root_squash = on_off(text)?;
            Ok(())
        },
        create_only: false,
    },
    Spec {
        name: "io-timeout",
        kind: "seconds, 0 to 86400",
        default: "30",
        restarts_bricks: false,
        description: "how long a client's I/O waits for bricks that are away before it fails \
                      with ENOTCONN (like an NFS hard mount's patience); running clients take it within a second",
        get: |d| d.io_timeout.unwrap_or(30).to_string(),
        set: |d, text| {
            let s = digits(text)
                .then(|| text.parse::<u32>().ok())
                .flatten()
                .filter(|s| *s <= 86_400);
            d.io_timeout = Some(s.ok_or(None)?);
            Ok(())
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
                      is stuck: eight times this); running clients take it within a second",
        get: |d| d.ping_timeout.unwrap_or(1200).to_string(),
        set: |d, text| {
            let ms = digits(text)
                .then(|| text.parse::<u32>().ok())
                .flatten()
                .ok_or(None)?;
            if ms != 0 && !(200..=60_000).contains(&ms) {
                return Err(Some(format!(
                    "ping-timeout takes 0 (never) or 200 to 60000 milliseconds, not {text}: \
                     shorter takes a busy host for a lost one"
                )));
            }
            // Stored only when not the default, as short-circuit.
            d.ping_timeout = (ms != 1200).then_some(ms);
            Ok(())
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
        get: |d| if d.short_circuit == Some(false) { "off" } else { "on" }.into(),
        set: |d, text| {
            // Stored only when off: a volume left at the default keeps its clients' graph.
            d.short_circuit = (!on_off(text)?).then_some(false);
            Ok(())
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
        get: |d| {
            size_text(
                d.flush_behind
                    .unwrap_or(kiln_layer::layers::posix::DEFAULT_FLUSH_BEHIND),
            )
        },
        set: |d, text| {
            let w = parse_size(text).map_err(|_| None)?;
            // A window under 1 MiB would have nearly every write wait for a whole-file
            // write-back.
            if w != 0 && w < 1 << 20 {
                return Err(Some(format!("flush-behind takes 0 (off) or at least 1M, not {text:?}")));
            }
            // Stored only when not the default, as short-circuit.
            d.flush_behind = (w != kiln_layer::layers::posix::DEFAULT_FLUSH_BEHIND).then_some(w);
            Ok(())
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
        get: |d| if d.shared_secret == Some(false) { "off" } else { "on" }.into(),
        set: |d, text| {
            d.shared_secret = Some(on_off(text)?);
            Ok(())
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
        get: |d| d.shard_block.map_or("off".into(), size_text),
        set: |_, _| Err(Some(
            "shard-block-size is chosen when the volume is created (kiln volume create \
             --shard SIZE): the pieces of files already written depend on it"
                .into(),
        )),
        create_only: true,
    },
];

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
pub fn parse_size(text: &str) -> Result<u64, String> {
    let (num, shift) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("{text:?}: unknown unit {c:?} (want K, M, G or T)")),
            };
            (&text[..i], shift)
        }
        _ => (text, 0),
    };
    digits(num)
        .then(|| num.parse::<u64>().ok())
        .flatten()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| format!("{text:?} is not a size (e.g. 64M)"))
}

/// The option named `name`, or an error listing the options.
pub fn spec(name: &str) -> Result<&'static Spec, String> {
    OPTIONS.iter().find(|s| s.name == name).ok_or_else(|| {
        let names: Vec<&str> = OPTIONS.iter().map(|s| s.name).collect();
        format!("no volume option {name:?} (options: {})", names.join(", "))
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
pub(crate) fn parse_allow(text: &str) -> Result<Vec<String>, String> {
    if text == "all" {
        return Ok(Vec::new());
    }
    let ranges: Vec<String> = text.split(',').map(|c| c.trim().to_owned()).collect();
    if ranges.iter().any(String::is_empty) {
        return Err(format!(
            "allow {text:?} has an empty address range: give ranges separated by single \
             commas (10.0.0.0/24,192.168.1.7), or `all` to take clients from anywhere"
        ));
    }
    check_allow(&ranges)
}

/// An `allow` list: address ranges (ADDR/PREFIX), each checked.
pub(crate) fn check_allow(allow: &[String]) -> Result<Vec<String>, String> {
    for c in allow {
        // The address parser takes a prefix of "+8"; a range is written without signs.
        if c.contains('+') {
            return Err(format!(
                "allow {c:?}: not an address range (want e.g. 10.0.0.0/8)"
            ));
        }
        c.parse::<kiln_server::access::Cidr>()
            .map_err(|e| format!("allow {c:?}: {e}"))?;
    }
    Ok(allow.to_vec())
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
pub fn apply(def: &mut VolumeDef, name: &str, text: &str) -> Result<bool, String> {
    let s = spec(name)?;
    (s.set)(def, text)
        .map_err(|why| why.unwrap_or_else(|| format!("{name} takes {}, not {text:?}", s.kind)))?;
    Ok(s.restarts_bricks)
}

/// The `set` request that gives volume `volume` the option `name` the value `text` (checked
/// here, so a bad value is refused before a server is asked).
pub fn set_request(volume: &str, name: &str, text: &str) -> Result<Request, String> {
    apply(&mut VolumeDef::default(), name, text)?;
    Ok(Request::Set {
        name: volume.to_owned(),
        options: vec![(name.to_owned(), text.to_owned())],
    })
}

/// The one `set` request that gives volume `volume` the defaults of the options `names`.
pub fn reset_request(volume: &str, names: &[&str]) -> Result<Request, String> {
    let options = names
        .iter()
        .map(|n| Ok((spec(n)?.name.to_owned(), spec(n)?.default.to_owned())))
        .collect::<Result<_, String>>()?;
    Ok(Request::Set {
        name: volume.to_owned(),
        options,
    })
}

/// The options of `def` (`name`, or all of them) as `volume get` shows them.
pub fn values(def: &VolumeDef, name: Option<&str>) -> Result<Vec<OptionValue>, String> {
    let specs: Vec<&Spec> = match name {
        None | Some("all") => OPTIONS.iter().collect(),
        Some(n) => vec![spec(n)?],
    };
    Ok(specs
        .into_iter()
        .map(|s| OptionValue {
            name: s.name.into(),
            value: (s.get)(def),
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
            assert_eq!((s.get)(&fresh), s.default, "{}", s.name);
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
        assert!(e.contains("200 to 60000") && e.contains("busy host"), "{e}");
        let mut p = fresh.clone();
        apply(&mut p, "ping-timeout", "1200").unwrap();
        assert_eq!(p.ping_timeout, None);
        assert_eq!(d.ping_timeout, Some(3000));
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
            assert!(e.contains("allow"), "{bad:?}: {e}");
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
            .contains("on or off"));
        assert!(spec("nope").err().unwrap().contains("io-timeout"));
        assert!(set_request("v", "shard-block-size", "4M")
            .unwrap_err()
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
}
