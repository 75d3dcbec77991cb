//! The brick's pushes of other clients' changes: asked for, and asked for again after every
//! reconnect (with "everything changed" for what went unpushed meanwhile).

use std::io;

use kiln_proto::codec::{Seq, Wire};
use kiln_proto::ops::Changes;
use kiln_proto::sync::MutexExt as _;

use super::{Link, ProtocolClient};
use crate::conn::PushSink;
use crate::Client;

impl ProtocolClient {
    /// Sends the brick's pushes ([`kiln_proto::Op::Watch`]) to `sink`, now and on every
    /// later connection. An error (the brick down, or one that cannot push) leaves the sink
    /// in place for the next connection.
    pub async fn watch(&self, sink: PushSink) -> io::Result<()> {
        *self.link.push.locked() = Some(sink.clone());
        self.client().watch(Some(sink)).await
    }

    /// The sink pushes go to, if this layer watches.
    pub fn push_sink(&self) -> Option<PushSink> {
        self.link.push.locked().clone()
    }
}

/// After a reconnect to `c`: watch again, then tell the sink that anything may have changed
/// (or, if the brick will not push, that pushes stopped).
pub(super) fn rewatch(link: &Link, name: &str, c: &Client) {
    let sink = link.push.locked().clone();
    let Some(sink) = sink else {
        return;
    };
    if let Err(e) = crate::block_on(c.watch(Some(sink.clone()))) {
        tracing::warn!(layer = name, "cannot watch the brick again: {e}");
        // No pushes from it: said with an empty push.
        sink(&[]);
        return;
    }
    let all = Changes {
        all: true,
        changes: Seq(Vec::new()),
    };
    sink(&all.to_wire());
}
