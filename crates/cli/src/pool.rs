//! `kiln peer …` and `kiln pool list`: the trusted storage pool — the kilnds that share
//! volume definitions, replicated with Raft (see `kiln_mgmt::pool`). Any member answers and
//! forwards changes to the leader; the same `--server`, `--json` and secret options as
//! `kiln volume`.

use kiln_mgmt::response::{Joined, PeerDetached, PoolView};
use kiln_mgmt::Request;

use crate::volume::{mgmt_call, show, warn, MgmtOpts};
use kiln_proto::Error;

/// Pool members: add, remove, list.
#[derive(clap::Args, Debug)]
pub struct PeerArgs {
    #[command(subcommand)]
    cmd: PeerCmd,
}

#[derive(clap::Subcommand, Debug)]
enum PeerCmd {
    /// Add the kilnd at HOST[:PORT] (default port 24007) to this kilnd's pool.
    ///
    /// The new kilnd must hold the same management secret (copy STATE_DIR/mgmt.secret before
    /// it first starts) and be in no pool of its own that holds anything. It catches up with
    /// the pool's store, then votes. Run on any member: the change is made by the leader.
    #[command(after_help = "Examples:\n  kiln peer probe 10.0.0.2\n  kiln peer probe node3:24017")]
    Probe {
        /// The kilnd's management address: HOST or HOST:PORT.
        host: String,
        #[command(flatten)]
        opts: MgmtOpts,
    },
    /// Remove a member from the pool: HOST, HOST:PORT or its id (as `pool list` prints it).
    ///
    /// The removed kilnd forgets the pool and is alone again. With three voters, detaching
    /// one leaves two, and then both are needed for any change.
    Detach {
        /// The member: HOST, HOST:PORT or id.
        host: String,
        #[command(flatten)]
        opts: MgmtOpts,
    },
    /// The other members, their roles, and whether the kilnd asked can reach them.
    Status(MgmtOpts),
}

/// The pool as a whole.
#[derive(clap::Args, Debug)]
pub struct PoolArgs {
    #[command(subcommand)]
    cmd: PoolCmd,
}

#[derive(clap::Subcommand, Debug)]
enum PoolCmd {
    /// Every member (this one too): id, address, role (leader, voter, learner), reachable.
    List(MgmtOpts),
}

/// `kiln peer …`.
pub fn peer(args: PeerArgs) -> Result<(), Error> {
    match args.cmd {
        PeerCmd::Probe { host, opts } => {
            let r: Joined = mgmt_call(&opts, &Request::PeerProbe { host: host.clone() })?;
            show(&opts, &r, |r| {
                format!(
                    "peer probe: success: {host} is member {:016x}; the pool has {} members\n",
                    r.id, r.members
                )
            });
            Ok(())
        }
        PeerCmd::Detach { host, opts } => {
            let r: PeerDetached = mgmt_call(&opts, &Request::PeerDetach { host })?;
            show(&opts, &r, |r| {
                format!("peer detach: success: {}\n", r.detached)
            });
            warn(&r.warnings);
            Ok(())
        }
        PeerCmd::Status(opts) => {
            let r: PoolView = mgmt_call(&opts, &Request::PoolList)?;
            show(&opts, &r, |r| {
                let others: Vec<_> = r.members.iter().filter(|m| !m.this).collect();
                let mut out = format!("Number of Peers: {}\n", others.len());
                for m in others {
                    out += &format!(
                        "\nHostname: {}\nId: {:016x}\nRole: {}\nState: {}\n",
                        m.addr,
                        m.id,
                        m.role,
                        reach(m.reachable)
                    );
                }
                out
            });
            Ok(())
        }
    }
}

fn reach(r: Option<bool>) -> &'static str {
    match r {
        Some(true) => "Connected",
        Some(false) => "Disconnected",
        None => "Unknown",
    }
}

/// `kiln pool …`.
pub fn pool(args: PoolArgs) -> Result<(), Error> {
    match args.cmd {
        PoolCmd::List(opts) => {
            let r: PoolView = mgmt_call(&opts, &Request::PoolList)?;
            show(&opts, &r, list_text);
            Ok(())
        }
    }
}

fn list_text(r: &PoolView) -> String {
    let mut out = format!(
        "{:<16}  {:<24}  {:<8}  {:<12}\n",
        "ID", "ADDRESS", "ROLE", "STATE"
    );
    for m in &r.members {
        let addr = if m.this {
            format!("{} (this)", m.addr)
        } else {
            m.addr.clone()
        };
        out += &format!(
            "{:016x}  {addr:<24}  {:<8}  {:<12}\n",
            m.id,
            m.role,
            reach(m.reachable)
        );
    }
    let leader = r
        .leader
        .map_or_else(|| "none (no majority)".to_owned(), |l| format!("{l:016x}"));
    out += &format!(
        "leader {leader}, term {}, store version {}\n",
        r.term, r.version
    );
    out
}
