//! How a stopped server ends its connections: the bound every listener of the agent gives them
//! ([`CONNECTION_DRAIN`]), and the bounded end of a set of them ([`end_connections`]). The
//! bottom layer (it names no other module): the proxy, the control API and the metrics listener
//! use it. The agent's own stop is [`crate::agent::Stop`].
use std::time::Duration;

use tokio::task::JoinSet;

/// How long a stopped listener waits for its connections' tasks to end (each ends at its stop
/// at once, recording its end, or finishes the request in flight).
pub const CONNECTION_DRAIN: Duration = Duration::from_secs(1);

/// A server's connections once it stopped accepting (the API, the metrics listener): those
/// still open get `within` to finish, the rest are aborted; every one is awaited.
pub async fn end_connections(mut conns: JoinSet<()>, within: Duration) {
    let drained = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(within, drained).await.is_err() {
        tracing::debug!(
            connections = conns.len(),
            "connections still open at the stop: ended"
        );
        conns.shutdown().await;
    }
}
