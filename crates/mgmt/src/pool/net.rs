//! Raft between kilnds: openraft's RPCs ride the management port as `raft` MGMT requests on
//! an authenticated connection (both ends prove the management secret, as for every
//! kilnd-to-kilnd command), kept open per peer and opened again after a failure.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_proto::sync::MutexExt as _;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::BasicNode;
use serde::{de::DeserializeOwned, Serialize};

use super::link::{Channel, Link};
use super::types::{Kiln, Msg, NodeId, RaftReply, Rpc};

/// Makes [`Conn`]s over the daemon's [`Link`].
pub struct Net {
    pub(super) link: Arc<dyn Link>,
}

impl RaftNetworkFactory<Kiln> for Net {
    type Network = Conn;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Conn {
        Conn {
            target,
            addr: node.addr.clone(),
            link: self.link.clone(),
            conn: Arc::new(Mutex::new(None)),
        }
    }
}

/// The connection to one member (opened when first used).
pub struct Conn {
    target: NodeId,
    addr: String,
    link: Arc<dyn Link>,
    conn: Arc<Mutex<Option<Box<dyn Channel>>>>,
}

/// Why a call failed: the member could not be reached, or the exchange broke.
enum Failed {
    Unreachable(String),
    Network(String),
}

impl Conn {
    async fn call<T, E>(
        &mut self,
        rpc: Rpc,
        body: impl Serialize,
        ttl: Duration,
    ) -> Result<T, RPCError<NodeId, BasicNode, E>>
    where
        T: DeserializeOwned + Send + 'static,
        E: std::error::Error + DeserializeOwned + Send + 'static,
    {
        let req = Msg::Raft {
            to: self.target,
            rpc,
            body: serde_json::to_value(body).expect("raft messages serialise"),
        };
        let req = serde_json::to_value(req).expect("raft messages serialise");
        let (addr, link, conn) = (self.addr.clone(), self.link.clone(), self.conn.clone());
        let out = tokio::task::spawn_blocking(move || {
            let mut slot = conn.locked();
            if slot.is_none() {
                let sa = addr
                    .parse()
                    .map_err(|e| Failed::Unreachable(format!("member address {addr}: {e}")))?;
                *slot = Some(
                    link.connect(sa)
                        .map_err(|e| Failed::Unreachable(e.to_string()))?,
                );
            }
            let c = slot.as_mut().expect("opened above");
            let r = c
                .call(&req, Some(ttl))
                .map_err(|e| e.to_string())
                .and_then(|v| {
                    serde_json::from_value::<RaftReply>(v)
                        .map_err(|e| format!("bad raft reply: {e}"))
                });
            if r.is_err() {
                // The next call opens a new connection.
                *slot = None;
            }
            r.map_err(Failed::Network)
        })
        .await;
        let reply = match out {
            Ok(Ok(r)) => r,
            Ok(Err(Failed::Unreachable(e))) => {
                return Err(RPCError::Unreachable(Unreachable::new(
                    &std::io::Error::other(e),
                )))
            }
            Ok(Err(Failed::Network(e))) => {
                return Err(RPCError::Network(NetworkError::new(
                    &std::io::Error::other(e),
                )))
            }
            Err(e) => return Err(RPCError::Network(NetworkError::new(&e))),
        };
        let r: Result<T, E> = serde_json::from_value(reply.reply)
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<Kiln> for Conn {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<Kiln>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(Rpc::Append, rpc, option.hard_ttl()).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<Kiln>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        self.call(Rpc::Snapshot, rpc, option.hard_ttl()).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        self.call(Rpc::Vote, rpc, option.hard_ttl()).await
    }
}
