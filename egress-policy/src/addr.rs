//! The built-in address deny list, checked on every address the proxy is about to dial.
//!
//! IPv6 forms that embed an IPv4 address (v4-mapped `::ffff:a.b.c.d`, NAT64 `64:ff9b::/96`,
//! 6to4 `2002::/16`) are unmapped first and the embedded IPv4 address is checked too, so
//! `::ffff:127.0.0.1` is loopback. An operator opens one of these ranges only with an explicit
//! `allow_cidrs` entry in the policy.
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::LazyLock;

use ipnet::IpNet;

/// Built-in denied ranges with a short label (used in logs, never trusted as input).
pub const BUILTIN_DENY: &[(&str, &str)] = &[
    ("0.0.0.0/8", "this-network"),
    ("10.0.0.0/8", "rfc1918"),
    ("100.64.0.0/10", "cgnat"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"), // includes 169.254.169.254 and 169.254.170.2 (cloud metadata)
    ("172.16.0.0/12", "rfc1918"),
    ("192.0.0.0/24", "ietf-protocol"),
    ("192.0.2.0/24", "documentation"),
    ("192.88.99.0/24", "6to4-relay"),
    ("192.168.0.0/16", "rfc1918"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"), // includes 255.255.255.255
    ("::/128", "unspecified"),
    ("::1/128", "loopback"),
    ("::/96", "v4-compatible"),
    ("64:ff9b:1::/48", "nat64-local"),
    ("100::/64", "discard"),
    ("2001::/32", "teredo"),
    ("2001:10::/28", "orchid"),
    ("2001:db8::/32", "documentation"),
    ("fc00::/7", "unique-local"), // includes fd00:ec2::254 (AWS metadata over IPv6)
    ("fd00:ec2::254/128", "cloud-metadata"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
];

static BUILTIN: LazyLock<Vec<(IpNet, &'static str)>> = LazyLock::new(|| {
    BUILTIN_DENY
        .iter()
        .filter_map(|(net, label)| net.parse::<IpNet>().ok().map(|n| (n, *label)))
        .collect()
});

/// Unmap IPv4-mapped IPv6 (`::ffff:a.b.c.d`) to IPv4; other addresses are returned unchanged.
pub fn unmap(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// The IPv4 address embedded in NAT64 (`64:ff9b::/96`) or 6to4 (`2002::/16`) addresses.
fn embedded_v4(v6: &Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
        return Some(Ipv4Addr::new(
            (s[6] >> 8) as u8,
            s[6] as u8,
            (s[7] >> 8) as u8,
            s[7] as u8,
        ));
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    None
}

fn builtin_label(ip: IpAddr) -> Option<&'static str> {
    BUILTIN
        .iter()
        .find(|(net, _)| net.contains(&ip))
        .map(|(_, l)| *l)
}

/// If the built-in list denies `ip` (after unmapping), the range label.
pub fn builtin_denied(ip: IpAddr) -> Option<&'static str> {
    let ip = unmap(ip);
    if let Some(label) = builtin_label(ip) {
        return Some(label);
    }
    if let IpAddr::V6(v6) = ip
        && let Some(v4) = embedded_v4(&v6)
    {
        return builtin_label(IpAddr::V4(v4));
    }
    None
}

/// Does one range of the built-in deny list contain all of `net`?
pub fn builtin_covers(net: &IpNet) -> bool {
    BUILTIN.iter().any(|(b, _)| b.contains(net))
}

/// Does any of `nets` contain `ip` (unmapped first; IPv4 nets also match the v4 embedded in v6)?
pub fn any_contains(nets: &[IpNet], ip: IpAddr) -> bool {
    let ip = unmap(ip);
    nets.iter().any(|n| n.contains(&ip))
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    fn denied(s: &str) -> bool {
        builtin_denied(s.parse().unwrap()).is_some()
    }

    #[test]
    fn builtin_list_parses_completely() {
        assert_eq!(BUILTIN.len(), BUILTIN_DENY.len());
    }

    #[test]
    fn private_and_special_addresses_are_denied() {
        for a in [
            "127.0.0.1",
            "127.255.255.254",
            "0.0.0.0",
            "0.1.2.3",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "100.64.0.1",
            "100.127.255.255",
            "169.254.169.254",
            "169.254.170.2",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            "192.0.2.1",
            "198.18.0.1",
            "::1",
            "::",
            "fc00::1",
            "fd12:3456::1",
            "fe80::1",
            "fd00:ec2::254",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::7f00:1",
            "64:ff9b::a00:1",
            "2002:7f00:1::1",
            "2002:a9fe:a9fe::1",
            "2001:db8::1",
        ] {
            assert!(denied(a), "{a} not denied");
        }
    }

    #[test]
    fn public_addresses_pass() {
        for a in [
            "1.1.1.1",
            "8.8.8.8",
            "140.82.112.3",
            "100.63.255.255",
            "100.128.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "169.253.255.255",
            "2606:4700::1111",
            "2a00:1450::1",
            "::ffff:1.1.1.1",
            "64:ff9b::101:101",
            "2002:101:101::1",
        ] {
            assert!(!denied(a), "{a} denied");
        }
    }

    #[test]
    fn unmapping() {
        assert_eq!(
            unmap("::ffff:1.2.3.4".parse().unwrap()),
            "1.2.3.4".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            unmap("::1".parse().unwrap()),
            "::1".parse::<IpAddr>().unwrap()
        );
        let nets: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        assert!(any_contains(&nets, "::ffff:10.9.9.9".parse().unwrap()));
        assert!(!any_contains(&nets, "11.0.0.1".parse().unwrap()));
    }
}
