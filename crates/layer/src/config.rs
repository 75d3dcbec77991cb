//! A layer type's options, declared once.
//!
//! Each layer type that takes options owns one struct of them, declared with
//! [`layer_options!`](crate::layer_options): the struct is what a volfile's `[[layer]]` table
//! parses into (unknown options refused), and the same declaration gives the table of names,
//! types, defaults and doc comments that `kiln volume layers` prints. A volume option of
//! `kiln volume set` that configures a layer names the type and the field (see
//! `kiln_mgmt::options`); nothing else lists them.
//!
//! The protocol-client's options are here because its layer lives with the client, but every
//! side parses every volfile.

/// One documented option of a layer type.
#[derive(Debug)]
pub struct OptionDoc {
    /// Option name, as written in a volfile.
    pub name: &'static str,
    /// Its type.
    pub ty: &'static str,
    /// Default, or "required".
    pub default: &'static str,
    /// What it does: the field's doc comment, one line per comment line.
    pub doc: &'static str,
}

impl OptionDoc {
    /// What it does, as one line.
    pub fn text(&self) -> String {
        self.doc.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}

/// The options struct of a layer type.
pub trait Options {
    /// Every option, in declaration order.
    const DOCS: &'static [OptionDoc];

    /// Whether `field` is one of them.
    fn has(field: &str) -> bool {
        Self::DOCS.iter().any(|d| d.name == field)
    }
}

/// Declares a layer type's options struct and its [`Options::DOCS`].
///
/// Each field carries, in this order, its doc comment, `#[option(ty = "…", default = "…")]`
/// (how `kiln volume layers` shows its type and default), then any serde attributes; a field
/// without a serde default is required. The struct refuses unknown fields; it derives
/// `Debug`, `Clone`, `PartialEq` and serde's traits, and takes more derives (`Default`) above
/// it.
#[macro_export]
macro_rules! layer_options {
    (
        $(#[$smeta:meta])*
        pub struct $name:ident {
            $(
                $(#[doc = $doc:literal])*
                #[option(ty = $ty:literal, default = $default:literal)]
                $(#[$attr:meta])*
                pub $field:ident : $fty:ty,
            )*
        }
    ) => {
        $(#[$smeta])*
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $name {
            $(
                $(#[doc = $doc])*
                $(#[$attr])*
                pub $field: $fty,
            )*
        }

        impl $crate::config::Options for $name {
            const DOCS: &'static [$crate::config::OptionDoc] = &[
                $($crate::config::OptionDoc {
                    name: stringify!($field),
                    ty: $ty,
                    default: $default,
                    doc: concat!($($doc, "\n"),*),
                },)*
            ];
        }
    };
}

layer_options! {
    /// The options of a protocol-client layer: one connection to a brick (client side).
    pub struct ProtocolClientConfig {
        /// The brick's address: `tcp:HOST:PORT`, `HOST:PORT` or `unix:PATH`.
        #[option(ty = "address", default = "required")]
        pub remote: String,
        /// Seconds a fop waits for a lost connection to come back (reconnecting, reopening
        /// handles, sending again) before it fails with ENOTCONN; under a replicate layer 0,
        /// which goes on with the other replicas and waits for a quorum itself.
        #[option(ty = "seconds", default = "30 (0 under replicate)")]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub timeout: Option<u32>,
        /// Reads straight from the brick's files while it is on this host (a Unix socket) and
        /// grants them (`KILN_SHORT_CIRCUIT=off` turns it off where the graph does not say).
        #[option(ty = "bool", default = "true")]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub short_circuit: Option<bool>,
        /// Milliseconds a connection with requests waiting may go without a byte from the
        /// brick, its host acknowledging nothing either, before the brick is away; 0 never.
        /// One value per process: the last graph built sets it (a graph without it, the
        /// default), unless `KILN_PING_TIMEOUT_MS` is set.
        #[option(ty = "milliseconds", default = "1200")]
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub ping_timeout: Option<u32>,
    }
}

impl ProtocolClientConfig {
    /// A connection to `remote` with every other option at its default.
    pub fn to(remote: impl Into<String>) -> ProtocolClientConfig {
        ProtocolClientConfig {
            remote: remote.into(),
            timeout: None,
            short_circuit: None,
            ping_timeout: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    layer_options! {
        /// Two options.
        pub struct Two {
            /// The first,
            /// on two lines.
            #[option(ty = "integer", default = "required")]
            pub first: u32,
            /// The second.
            #[option(ty = "bool", default = "false")]
            #[serde(default)]
            pub second: bool,
        }
    }

    #[test]
    fn the_declaration_gives_the_docs_and_the_serde_form() {
        let d = Two::DOCS;
        assert_eq!(d.len(), 2);
        assert_eq!(
            (d[0].name, d[0].ty, d[0].default),
            ("first", "integer", "required")
        );
        assert_eq!(d[0].text(), "The first, on two lines.");
        assert!(Two::has("second") && !Two::has("third"));
        let t: Two = toml::from_str("first = 3").unwrap();
        assert_eq!(
            t,
            Two {
                first: 3,
                second: false
            }
        );
        assert!(
            toml::from_str::<Two>("second = true").is_err(),
            "a required option"
        );
        assert!(
            toml::from_str::<Two>("first = 1\nthird = 1").is_err(),
            "an unknown one"
        );
    }
}
