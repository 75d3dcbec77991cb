//! `kiln auth …`: named identities — each client its own key, with capabilities the bricks
//! check on every request (see `kiln_server::identity`). Keys live in the pool's store and
//! reach every brick; removing or rotating one closes that identity's connections. The same
//! `--server`, `--json` and secret options as `kiln volume`.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use kiln_mgmt::identities::AuthOp;
use kiln_mgmt::response::IdentityList;
use kiln_mgmt::Request;
use kiln_server::identity::{Caps, Users};

use crate::volume::{mgmt_call, show, MgmtOpts};
use kiln_proto::error::Context as _;
use kiln_proto::Error;

/// Identities: add, list, get, caps, rotate, rm.
#[derive(clap::Args, Debug)]
pub struct AuthArgs {
    #[command(subcommand)]
    cmd: AuthCmd,
}

/// What an identity may do, as options.
#[derive(clap::Args, Debug)]
struct CapsOpts {
    /// A volume it may use (repeat for more; `*` for all).
    #[arg(long = "volume", value_name = "NAME", required = true)]
    volumes: Vec<String>,
    /// It may read but change nothing (EROFS).
    #[arg(long)]
    read_only: bool,
    /// Confine it to this subtree of the volume (e.g. /t1): elsewhere only the attributes of
    /// the directories on the way there.
    #[arg(long, value_name = "PATH")]
    subtree: Option<String>,
    /// Whose credentials its requests run with: `as-caller` (a trusted host whose mounts send
    /// each caller's; uid 0 and gid 0 become nobody unless --root) or `UID:GID` (always that
    /// user, like NFS all_squash: image hosts, kiln nbd, libkiln).
    #[arg(
        long = "as",
        value_name = "as-caller|UID:GID",
        default_value = "as-caller"
    )]
    users: Users,
    /// Its requests may run as root (uid 0, gid 0, or without credentials).
    #[arg(long)]
    root: bool,
    /// It may make character and block device nodes.
    #[arg(long)]
    devices: bool,
    /// It may run management commands (`kiln volume`, `kiln auth`, …) with its key.
    #[arg(long)]
    admin: bool,
    /// It may connect only from this network (CIDR, e.g. 10.1.0.0/16 or 10.1.2.3; repeat for
    /// more): its key is refused anywhere else. Unix-socket clients are on the brick's host
    /// and always admitted.
    #[arg(long = "from", value_name = "CIDR")]
    from: Vec<String>,
}

impl CapsOpts {
    fn caps(self) -> Result<Caps, Error> {
        let subtree = match self.subtree.as_deref().map(|s| s.trim_matches('/')) {
            None | Some("") => String::new(),
            Some(s) => s.to_owned(),
        };
        let caps = Caps {
            volumes: self.volumes,
            read_only: self.read_only,
            subtree,
            users: self.users,
            root: self.root,
            devices: self.devices,
            admin: self.admin,
            from: self.from,
        };
        caps.check()?;
        Ok(caps)
    }
}

#[derive(clap::Subcommand, Debug)]
enum AuthCmd {
    /// Make identity NAME with a new key and these capabilities; prints its key line (or
    /// writes it to --key-file, mode 0600): clients give that file as --secret-file.
    #[command(after_help = "Examples:\n  \
        kiln auth add hv1 --volume vms --as 107:107 --key-file /etc/kiln/hv1.key\n  \
        kiln auth add t2 --volume shared --subtree /t2 --read-only --as 2000:2000\n  \
        kiln auth add ops --volume '*' --admin --root")]
    Add {
        /// The identity's name (letters, digits, '.', '-', '_').
        name: String,
        #[command(flatten)]
        caps: CapsOpts,
        /// Write the key line here (mode 0600) instead of printing it.
        #[arg(long, value_name = "PATH")]
        key_file: Option<PathBuf>,
        #[command(flatten)]
        opts: MgmtOpts,
    },
    /// Every identity and its capabilities (no keys).
    List(MgmtOpts),
    /// One identity's capabilities and key line (or --key-file: the key written there).
    Get {
        /// The identity.
        name: String,
        /// Write the key line here (mode 0600) instead of printing it.
        #[arg(long, value_name = "PATH")]
        key_file: Option<PathBuf>,
        #[command(flatten)]
        opts: MgmtOpts,
    },
    /// Replace an identity's capabilities; its connections take them at their next request.
    Caps {
        /// The identity.
        name: String,
        #[command(flatten)]
        caps: CapsOpts,
        #[command(flatten)]
        opts: MgmtOpts,
    },
    /// Give an identity a new key: connections that proved the old one are closed.
    Rotate {
        /// The identity.
        name: String,
        /// Write the new key line here (mode 0600) instead of printing it.
        #[arg(long, value_name = "PATH")]
        key_file: Option<PathBuf>,
        #[command(flatten)]
        opts: MgmtOpts,
    },
    /// Remove an identity: its connections are closed and its key refused everywhere.
    Rm {
        /// The identity.
        name: String,
        #[command(flatten)]
        opts: MgmtOpts,
    },
}

fn describe(c: &Caps) -> String {
    let mut s = format!(
        "volumes {} {} users {}",
        c.volumes.join(","),
        if c.read_only {
            "read-only"
        } else {
            "read-write"
        },
        c.users
    );
    if !c.subtree.is_empty() {
        s += &format!(" subtree /{}", c.subtree);
    }
    for (on, what) in [(c.root, "root"), (c.devices, "devices"), (c.admin, "admin")] {
        if on {
            s += " ";
            s += what;
        }
    }
    if !c.from.is_empty() {
        s += &format!(" from {}", c.from.join(","));
    }
    s
}

/// Writes a key line to `path`, mode 0600 (a new file, or one replaced whole).
fn write_key(path: &Path, line: &str) -> Result<(), Error> {
    let tmp = path.with_extension("kiln-tmp");
    let r = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| writeln!(f, "{line}").and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    r.with_context(|| format!("cannot write key file {}", path.display()))
}

fn call(
    opts: &MgmtOpts,
    op: AuthOp,
    name: Option<String>,
    caps: Option<Caps>,
) -> Result<IdentityList, Error> {
    mgmt_call(opts, &Request::Auth { op, name, caps })
}

/// Prints an identity list, its key going to `key_file` instead when given.
fn print(
    opts: &MgmtOpts,
    mut r: IdentityList,
    what: &str,
    key_file: Option<&Path>,
) -> Result<(), Error> {
    if let Some(path) = key_file {
        if let Some(line) = r.identities.first_mut().and_then(|i| i.key.take()) {
            write_key(path, &line)?;
        }
    }
    show(opts, &r, |r| {
        let mut out = String::new();
        for i in &r.identities {
            out += &format!("{what}{}: {}\n", i.name, describe(&i.caps));
            if let Some(k) = &i.key {
                out += &format!("key: {k}\n");
            }
        }
        if let Some(p) = key_file {
            out += &format!("key written to {}\n", p.display());
        }
        out
    });
    Ok(())
}

/// `kiln auth …`.
pub fn main(args: AuthArgs) -> Result<(), Error> {
    match args.cmd {
        AuthCmd::Add {
            name,
            caps,
            key_file,
            opts,
        } => {
            let r = call(&opts, AuthOp::Add, Some(name), Some(caps.caps()?))?;
            print(&opts, r, "auth add: ", key_file.as_deref())
        }
        AuthCmd::List(opts) => {
            let r = call(&opts, AuthOp::List, None, None)?;
            print(&opts, r, "", None)
        }
        AuthCmd::Get {
            name,
            key_file,
            opts,
        } => {
            let r = call(&opts, AuthOp::Get, Some(name), None)?;
            print(&opts, r, "", key_file.as_deref())
        }
        AuthCmd::Caps { name, caps, opts } => {
            let r = call(&opts, AuthOp::Caps, Some(name), Some(caps.caps()?))?;
            print(&opts, r, "auth caps: ", None)
        }
        AuthCmd::Rotate {
            name,
            key_file,
            opts,
        } => {
            let r = call(&opts, AuthOp::Rotate, Some(name), None)?;
            print(&opts, r, "auth rotate: ", key_file.as_deref())
        }
        AuthCmd::Rm { name, opts } => {
            let r = call(&opts, AuthOp::Rm, Some(name), None)?;
            print(&opts, r, "auth rm: ", None)
        }
    }
}
