//! `egress-workload`: what a confined workload does while the agent restarts, measured.
//!
//! Runs until killed, from inside a confined container:
//! - every `--every-ms` (20), one DNS query for `--dns-name` to `--dns-server` (default: the
//!   resolver of /etc/resolv.conf; the kernel takes it to the agent's responder either way),
//!   answered within 1 s or lost, and one `GET --http-url` through the explicit proxy
//!   `--proxy`, a 200 within 2 s or failed;
//! - one CONNECT tunnel per `--tunnel HOST:PORT/INTERVAL_MS` through the proxy to an echo
//!   server, sending `ping N` lines every INTERVAL_MS and checking each echo; an error, an end or
//!   a wrong echo marks it cut (and it stays cut: a reconnect would hide the cut).
//!
//! Every 100 ms it prints one JSON line of totals (the last line is the state):
//! `{"ms":..,"dns_ok":..,"dns_lost":..,"http_ok":..,"http_failed":..,"dns_gap_ms":..,
//! "http_gap_ms":..,"slowest_failure_ms":..,"tunnels":[{"pings":..,"cut":false}]}`. A gap is the
//! longest time between two consecutive successes of a kind; `slowest_failure_ms` the longest a
//! failed query or request took (a hang would show there).
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};

#[derive(Default)]
struct Kind {
    ok: AtomicU64,
    bad: AtomicU64,
    /// (last success, longest gap) in ms since start.
    gap: Mutex<(Option<u64>, u64)>,
}

impl Kind {
    fn success(&self, now_ms: u64) {
        self.ok.fetch_add(1, Ordering::Relaxed);
        let mut g = self.gap.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(last) = g.0 {
            g.1 = g.1.max(now_ms - last);
        }
        g.0 = Some(now_ms);
    }
    fn gap(&self) -> u64 {
        self.gap.lock().unwrap_or_else(|p| p.into_inner()).1
    }
}

struct Tunnel {
    pings: AtomicU64,
    cut: AtomicBool,
    why: Mutex<String>,
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.windows(2).find(|w| w[0] == name).map(|w| w[1].clone())
}

fn resolver(args: &[String]) -> SocketAddr {
    if let Some(ip) = arg(args, "--dns-server") {
        return SocketAddr::new(ip.parse().expect("--dns-server"), 53);
    }
    let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    let ip = conf
        .lines()
        .find_map(|l| l.strip_prefix("nameserver "))
        .map(str::trim)
        .unwrap_or("127.0.0.11");
    SocketAddr::new(ip.parse().expect("resolver address"), 53)
}

fn dns_once(server: SocketAddr, name: &Name, id: u16) -> Result<(), String> {
    let mut m = Message::query();
    m.metadata.id = id;
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(name.clone(), RecordType::A));
    let bytes = m.to_vec().map_err(|e| e.to_string())?;
    let s = UdpSocket::bind("0.0.0.0:0").map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(1)))
        .map_err(|e| e.to_string())?;
    s.send_to(&bytes, server).map_err(|e| e.to_string())?;
    let mut buf = [0u8; 1500];
    loop {
        let (n, _) = s.recv_from(&mut buf).map_err(|e| e.to_string())?;
        let Ok(answer) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        if answer.metadata.id != id {
            continue;
        }
        let code = answer.metadata.response_code;
        return if code == ResponseCode::NoError && !answer.answers.is_empty() {
            Ok(())
        } else {
            Err(format!("answer {code:?}"))
        };
    }
}

fn http_once(proxy: SocketAddr, url: &str, host: &str) -> Result<(), String> {
    let mut s =
        TcpStream::connect_timeout(&proxy, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).map_err(|e| e.to_string())?;
    if &head[9..12] != b"200" {
        return Err(String::from_utf8_lossy(&head).into_owned());
    }
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).map_err(|e| e.to_string())?;
    Ok(())
}

fn tunnel(proxy: SocketAddr, target: &str, every: Duration, t: &Tunnel) -> String {
    let run = || -> Result<(), String> {
        let mut s = TcpStream::connect(proxy).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| e.to_string())?;
        write!(s, "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n")
            .map_err(|e| e.to_string())?;
        let mut r = BufReader::new(s.try_clone().map_err(|e| e.to_string())?);
        let mut line = String::new();
        r.read_line(&mut line)
            .map_err(|e| format!("CONNECT answer: {e}"))?;
        if !line.contains(" 200") {
            return Err(format!("CONNECT answered {line:?}"));
        }
        loop {
            line.clear();
            r.read_line(&mut line).map_err(|e| e.to_string())?;
            if line == "\r\n" {
                break;
            }
        }
        for n in 1u64.. {
            writeln!(s, "ping {n}").map_err(|e| format!("send ping {n}: {e}"))?;
            line.clear();
            let read = r
                .read_line(&mut line)
                .map_err(|e| format!("echo of ping {n}: {e}"))?;
            if read == 0 {
                return Err(format!("tunnel ended before the echo of ping {n}"));
            }
            if line.trim_end() != format!("ping {n}") {
                return Err(format!("echo of ping {n} was {line:?}"));
            }
            t.pings.store(n, Ordering::Relaxed);
            std::thread::sleep(every);
        }
        Ok(())
    };
    run().err().unwrap_or_default()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let proxy: SocketAddr = arg(&args, "--proxy")
        .unwrap_or_else(|| "169.254.100.1:3128".into())
        .parse()
        .expect("--proxy");
    let name = arg(&args, "--dns-name").unwrap_or_else(|| "allowed.test".into());
    let url = arg(&args, "--http-url").unwrap_or_else(|| "http://allowed.test:8080/".into());
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_owned();
    let every = Duration::from_millis(
        arg(&args, "--every-ms")
            .and_then(|v| v.parse().ok())
            .unwrap_or(20),
    );
    let start = Instant::now();
    let ms = move || u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
    let dns = Arc::new(Kind::default());
    let http = Arc::new(Kind::default());
    let slowest_failure = Arc::new(AtomicU64::new(0));
    let mut tunnels = Vec::new();
    for spec in args
        .windows(2)
        .filter(|w| w[0] == "--tunnel")
        .map(|w| w[1].clone())
    {
        let (target, interval) = spec
            .split_once('/')
            .expect("--tunnel HOST:PORT/INTERVAL_MS");
        let interval = Duration::from_millis(interval.parse().expect("interval"));
        let t = Arc::new(Tunnel {
            pings: AtomicU64::new(0),
            cut: AtomicBool::new(false),
            why: Mutex::new(String::new()),
        });
        tunnels.push(t.clone());
        let target = target.to_owned();
        std::thread::spawn(move || {
            let why = tunnel(proxy, &target, interval, &t);
            *t.why.lock().unwrap_or_else(|p| p.into_inner()) = why;
            t.cut.store(true, Ordering::Relaxed);
        });
    }
    {
        let (dns, slowest) = (dns.clone(), slowest_failure.clone());
        let name = Name::from_ascii(format!("{name}.")).expect("--dns-name");
        let server = resolver(&args);
        std::thread::spawn(move || {
            for id in (0..=u16::MAX).cycle() {
                let t0 = ms();
                match dns_once(server, &name, id) {
                    Ok(()) => dns.success(ms()),
                    Err(_) => {
                        dns.bad.fetch_add(1, Ordering::Relaxed);
                        slowest.fetch_max(ms() - t0, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(every);
            }
        });
    }
    {
        let (http, slowest) = (http.clone(), slowest_failure.clone());
        std::thread::spawn(move || {
            loop {
                let t0 = ms();
                match http_once(proxy, &url, &host) {
                    Ok(()) => http.success(ms()),
                    Err(_) => {
                        http.bad.fetch_add(1, Ordering::Relaxed);
                        slowest.fetch_max(ms() - t0, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(every);
            }
        });
    }
    let mut out = std::io::stdout();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let tunnels: Vec<serde_json::Value> = tunnels
            .iter()
            .map(|t| {
                serde_json::json!({
                    "pings": t.pings.load(Ordering::Relaxed),
                    "cut": t.cut.load(Ordering::Relaxed),
                    "why": *t.why.lock().unwrap_or_else(|p| p.into_inner()),
                })
            })
            .collect();
        let line = serde_json::json!({
            "ms": ms(),
            "dns_ok": dns.ok.load(Ordering::Relaxed),
            "dns_lost": dns.bad.load(Ordering::Relaxed),
            "http_ok": http.ok.load(Ordering::Relaxed),
            "http_failed": http.bad.load(Ordering::Relaxed),
            "dns_gap_ms": dns.gap(),
            "http_gap_ms": http.gap(),
            "slowest_failure_ms": slowest_failure.load(Ordering::Relaxed),
            "tunnels": tunnels,
        });
        if writeln!(out, "{line}").is_err() {
            return;
        }
    }
}
