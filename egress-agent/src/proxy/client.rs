//! Which workload inside a listener's identity a connection or query comes from.
//!
//! A listener serves one identity (a container, or a whole pod: every container of a pod shares
//! its listener, as its kernel entry). Events name the identity; for a pod they should also name
//! the container that asked (`k8s.container.name`). The listener can't tell its clients apart by
//! address (a pod's containers share one network namespace), but the kernel can by the client
//! socket's cgroup: a [`ClientNames`] (set on the identity by the runtime) looks it up from the
//! connection's addresses. Each connection task, and each DNS query, runs inside a
//! [`CLIENT`] scope holding those addresses; the names are looked up once, when the first event
//! of that connection is recorded, and never on a path that records nothing.
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::OnceLock;

/// Looks up the context that names a client of a listener (e.g. `k8s.container.name`).
pub trait ClientNames: Send + Sync + std::fmt::Debug {
    /// `client`: the peer as the listener sees it; `local`: the listener's own address (what the
    /// client's socket is connected to, after the kernel's redirect); `udp`: a DNS datagram.
    fn names(&self, client: SocketAddr, local: SocketAddr, udp: bool) -> BTreeMap<String, String>;
}

/// The connection (or DNS query) being served by this task.
#[derive(Debug)]
pub struct Client {
    peer: SocketAddr,
    local: SocketAddr,
    udp: bool,
    names: OnceLock<BTreeMap<String, String>>,
}

tokio::task_local! {
    /// Set around each connection's task and each DNS query (see the module docs).
    pub static CLIENT: Client;
}

impl Client {
    pub fn tcp(peer: SocketAddr, local: SocketAddr) -> Client {
        Client {
            peer,
            local,
            udp: false,
            names: OnceLock::new(),
        }
    }

    pub fn udp(peer: SocketAddr, local: SocketAddr) -> Client {
        Client {
            udp: true,
            ..Client::tcp(peer, local)
        }
    }
}

/// The names of the client served by the current task, looked up through `by` the first time.
/// Empty outside a [`CLIENT`] scope.
pub fn current_names(by: &dyn ClientNames) -> BTreeMap<String, String> {
    CLIENT
        .try_with(|c| {
            c.names
                .get_or_init(|| by.names(c.peer, c.local, c.udp))
                .clone()
        })
        .unwrap_or_default()
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Debug, Default)]
    struct Counting(AtomicUsize);

    impl ClientNames for Counting {
        fn names(&self, client: SocketAddr, _: SocketAddr, udp: bool) -> BTreeMap<String, String> {
            self.0.fetch_add(1, Ordering::SeqCst);
            BTreeMap::from([(
                "who".to_owned(),
                format!("{}{}", client.port(), if udp { "/udp" } else { "" }),
            )])
        }
    }

    #[tokio::test]
    async fn names_are_looked_up_once_per_client_and_only_inside_its_scope() {
        let by = Counting::default();
        assert!(current_names(&by).is_empty(), "no client outside a scope");
        let (peer, local) = (
            "10.0.0.5:4000".parse().unwrap(),
            "169.254.100.1:9".parse().unwrap(),
        );
        let names = CLIENT
            .scope(Client::tcp(peer, local), async {
                (current_names(&by), current_names(&by))
            })
            .await;
        assert_eq!(names.0["who"], "4000");
        assert_eq!(names.0, names.1);
        assert_eq!(by.0.load(Ordering::SeqCst), 1, "one lookup per connection");
        let udp = CLIENT.sync_scope(Client::udp(peer, local), || current_names(&by));
        assert_eq!(udp["who"], "4000/udp");
    }
}
