//! A network namespace with a veth pair to the host namespace, on TEST-NET addresses
//! (198.19.K.0/24 and 2001:db8:19:K::/64; the Docker tests use 198.18.0.0/24). Everything is
//! removed when the guard drops, also when a test panics.
use std::fs::File;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::{sh, sh_quiet};

pub struct Netns {
    pub name: String,
    /// veth end in the host namespace.
    pub host_if: String,
    /// veth end inside the namespace.
    pub ns_if: String,
    pub host_v4: Ipv4Addr,
    pub ns_v4: Ipv4Addr,
    /// A second address inside the namespace (e.g. the `allow_cidrs` destination).
    pub ns_v4_alt: Ipv4Addr,
    pub host_v6: Ipv6Addr,
    pub ns_v6: Ipv6Addr,
    pub ns_v6_alt: Ipv6Addr,
    /// Link-local address of `ns_if`.
    pub ns_v6_ll: Ipv6Addr,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl Netns {
    #[expect(
        clippy::new_without_default,
        reason = "creating a namespace is not a default value"
    )]
    pub fn new() -> Netns {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let k = ((pid + n * 7) % 250 + 1) as u8;
        let tag = format!("{:05}{n}", pid % 100_000);
        let ns = Netns {
            name: format!("egt-{tag}"),
            host_if: format!("egh{tag}"),
            ns_if: format!("egn{tag}"),
            host_v4: Ipv4Addr::new(198, 19, k, 1),
            ns_v4: Ipv4Addr::new(198, 19, k, 2),
            ns_v4_alt: Ipv4Addr::new(198, 19, k, 3),
            host_v6: format!("2001:db8:19:{k:x}::1").parse().expect("v6"),
            ns_v6: format!("2001:db8:19:{k:x}::2").parse().expect("v6"),
            ns_v6_alt: format!("2001:db8:19:{k:x}::3").parse().expect("v6"),
            ns_v6_ll: "fe80::19:2".parse().expect("v6"),
        };
        sh(&format!("ip netns add {}", ns.name));
        sh(&format!(
            "ip link add {} type veth peer name {}",
            ns.host_if, ns.ns_if
        ));
        sh(&format!("ip link set {} netns {}", ns.ns_if, ns.name));
        sh(&format!("ip addr add {}/24 dev {}", ns.host_v4, ns.host_if));
        sh(&format!(
            "ip -6 addr add {}/64 dev {} nodad",
            ns.host_v6, ns.host_if
        ));
        sh(&format!("ip link set {} up", ns.host_if));
        let inside = |c: &str| sh(&format!("ip netns exec {} {c}", ns.name));
        inside("ip link set lo up");
        inside(&format!("ip addr add {}/24 dev {}", ns.ns_v4, ns.ns_if));
        inside(&format!("ip addr add {}/24 dev {}", ns.ns_v4_alt, ns.ns_if));
        inside(&format!(
            "ip -6 addr add {}/64 dev {} nodad",
            ns.ns_v6, ns.ns_if
        ));
        inside(&format!(
            "ip -6 addr add {}/64 dev {} nodad",
            ns.ns_v6_alt, ns.ns_if
        ));
        inside(&format!(
            "ip -6 addr add {}/64 dev {} nodad",
            ns.ns_v6_ll, ns.ns_if
        ));
        inside(&format!("ip link set {} up", ns.ns_if));
        inside(&format!("ip route add default dev {}", ns.ns_if));
        inside(&format!("ip -6 route add default dev {}", ns.ns_if));
        // Wait for the link to be usable both ways.
        for _ in 0..50 {
            if sh_quiet(&format!("ping -c1 -W1 {} >/dev/null 2>&1", ns.ns_v4)) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        ns
    }

    /// Run `f` on a thread whose network namespace is this one (sockets it creates live here).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let file = File::open(&path).expect("open netns");
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("netns thread panicked")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        sh_quiet(&format!("ip link del {}", self.host_if));
        sh_quiet(&format!("ip netns del {}", self.name));
    }
}
