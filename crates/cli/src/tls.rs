//! `kiln tls`: a certificate authority and identities for TLS between clients and bricks.

use kiln_proto::error::Context as _;
use kiln_proto::Error;
use std::path::PathBuf;

/// Make certificates for TLS mode (kilnd --tls DIR, clients KILN_TLS_DIR=DIR).
///
/// Typical use: `kiln tls init /etc/kiln/ca`, then one `kiln tls issue` per brick host and per
/// client, each giving a directory with ca.pem, cert.pem and key.pem. Keep ca.key (the CA's
/// private key) off the machines that only serve or mount.
#[derive(clap::Args, Debug)]
pub struct TlsArgs {
    #[command(subcommand)]
    cmd: TlsCmd,
    /// Print the result as one JSON object, {"ok": true, …} (errors as {"ok": false,
    /// "error": …}).
    #[arg(long, global = true)]
    json: bool,
}

#[derive(clap::Subcommand, Debug)]
enum TlsCmd {
    /// Create a certificate authority: DIR/ca.pem and DIR/ca.key (mode 0600).
    Init {
        /// Where to put it (created; existing files are never overwritten).
        dir: PathBuf,
        /// The CA's name, as shown in its certificate.
        #[arg(long, default_value = "Kiln CA")]
        name: String,
    },
    /// Issue an identity (cert.pem, key.pem and a copy of ca.pem) signed by a CA. The same
    /// certificate serves a brick and a client.
    Issue {
        /// The CA directory made by `kiln tls init`.
        #[arg(long, value_name = "DIR")]
        ca: PathBuf,
        /// Where to put the identity (created; existing files are never overwritten).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// The identity's name (host name of a brick, or a client's name); it is also a
        /// subject alternative name.
        name: String,
        /// More names the certificate is valid for: host names and IP addresses clients dial
        /// (repeat). Bricks on loopback want --san 127.0.0.1 --san localhost.
        #[arg(long, value_name = "NAME")]
        san: Vec<String>,
    },
}

pub fn main(args: TlsArgs) -> Result<(), Error> {
    match args.cmd {
        TlsCmd::Init { dir, name } => {
            kiln_tls::init_ca(&dir, &name)
                .with_context(|| format!("cannot create a CA in {}", dir.display()))?;
            let (cert, key) = (dir.join(kiln_tls::CA_FILE), dir.join(kiln_tls::CA_KEY_FILE));
            let r = serde_json::json!({
                "ca": name,
                "cert": cert.display().to_string(),
                "key": key.display().to_string(),
            });
            crate::out::show(args.json, &r, |_| {
                format!(
                    "created CA {name:?}: {} and {} (keep the key private)\n",
                    cert.display(),
                    key.display()
                )
            });
        }
        TlsCmd::Issue { ca, out, name, san } => {
            kiln_tls::issue(&ca, &out, &name, &san)
                .with_context(|| format!("cannot issue {name:?} into {}", out.display()))?;
            let r = serde_json::json!({
                "identity": name,
                "dir": out.display().to_string(),
                "san": san,
            });
            crate::out::show(args.json, &r, |_| {
                format!(
                    "issued {name:?} into {} (ca.pem, cert.pem, key.pem)\n",
                    out.display()
                )
            });
        }
    }
    Ok(())
}
