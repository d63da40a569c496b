//! Transparent interception and the agent's own DNS under `egress-agent exec`, with real clients
//! that are given **no proxy variables** (curl, python urllib, node fetch, busybox wget, glibc's
//! resolver, dig, busybox nslookup): the kernel redirects TCP on `allow_ports` to the policy's
//! transparent listener and port 53 to its DNS responder.
//!
//! Every refusal is checked where it would have arrived: the upstream web servers log each
//! request, the agent's upstream resolver (a recording dnsmasq) logs each query, canaries on
//! "public" addresses (a dummy interface) record each byte.
//!
//! Run as root (CI is root); unprivileged, each test says it skipped.
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use egress_tests::agent::{TestConfig, assert_enforcement_intact, exec_cmd, exec_script};
use egress_tests::canary::Canary;
use egress_tests::upstreams::{Dnsmasq, DummyNet, TempDir, TestCa, WebServer};
use egress_tests::{marker, root_or_skip};

static SERIAL: Mutex<()> = Mutex::new(());

const DNS: &str = "127.0.0.1:15353";
/// "Public" addresses on a dummy interface (outside the built-in deny list).
const PUBLIC_A: &str = "45.90.0.1";
const PUBLIC_B: &str = "45.90.0.2";

/// The upstream side of every test: a CA, web servers, the agent's resolver, public addresses.
struct Upstreams {
    dir: TempDir,
    ca: TestCa,
    dns: Dnsmasq,
    tls: WebServer,
    tls6: WebServer,
    http: WebServer,
    /// HTTP on a port outside `allow_ports`.
    http_other_port: WebServer,
    /// Where a lying DNS answer would send an allowed name.
    evil: WebServer,
    _public: DummyNet,
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test value")
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("test value")
}

impl Upstreams {
    fn start() -> Upstreams {
        let dir = TempDir::new("transparent");
        let ca = TestCa::new(dir.path(), &["app.test", "app6.test", "other.test"]);
        let dns = Dnsmasq::start(
            dir.path(),
            addr(DNS),
            &[
                ("app.test", ip("127.0.0.1")),
                ("other.test", ip("127.0.0.1")),
                ("app6.test", ip("::1")),
                ("direct.test", ip(PUBLIC_A)),
                ("audited.test", ip(PUBLIC_A)),
            ],
        );
        let public = DummyNet::new("egt-pub0", &[ip(PUBLIC_A), ip(PUBLIC_B)]);
        Upstreams {
            tls: WebServer::start(addr("127.0.0.1:18443"), Some(&ca), "tls"),
            tls6: WebServer::start(addr("[::1]:18443"), Some(&ca), "tls6"),
            http: WebServer::start(addr("127.0.0.1:18080"), None, "http"),
            http_other_port: WebServer::start(addr("127.0.0.1:18081"), None, "other-port"),
            evil: WebServer::start(addr("127.0.0.2:18443"), Some(&ca), "evil"),
            dir,
            ca,
            dns,
            _public: public,
        }
    }

    /// The agent's config: the resolver above, no hosts file, and `policies`.
    fn config(&self, v6: bool, policies: &str) -> TestConfig {
        let hosts = self.dir.path().join("hosts");
        std::fs::write(&hosts, "").expect("hosts");
        let v6 = if v6 {
            let port = std::net::TcpListener::bind("[::1]:0")
                .and_then(|l| l.local_addr())
                .expect("port")
                .port();
            format!("endpoint_v6 = \"[::1]:{port}\"\n")
        } else {
            String::new()
        };
        TestConfig::new(&format!(
            "{v6}\n[dns]\nnameservers = [\"{DNS}\"]\nhosts_file = \"{}\"\n\n{policies}",
            hosts.display()
        ))
    }
}

const WEB_POLICY: &str = r#"
[policies.web]
allow_hosts = ["app.test", "app6.test", { host = "direct.test", ports = [2222] }]
allow_ports = [18080, 18443]
resolve_private = ["127.0.0.0/8", "::1/128"]
"#;

/// Run `script` with `sh -c` under `exec --policy <policy>`, proxy variables removed: what the
/// command prints (stdout + stderr).
fn run_confined(cfg: &TestConfig, policy: &str, script: &str) -> String {
    exec_script(
        cfg,
        policy,
        &format!(
            "unset HTTP_PROXY HTTPS_PROXY http_proxy https_proxy ALL_PROXY all_proxy NO_PROXY no_proxy\n{script}"
        ),
    )
}

/// A python one-liner: TCP connect to `host:port`, send `payload`; prints `OK` or `ERR <errno>`.
fn tcp_send(host: &str, port: u16, payload: &str) -> String {
    format!(
        "python3 -c \"import socket,sys\ntry:\n s=socket.create_connection(('{host}',{port}),timeout=3); s.sendall(b'{payload}'); s.close(); print('OK {payload}')\nexcept OSError as e:\n print('ERR {payload}', e.errno)\""
    )
}

#[test]
fn allowed_names_are_reached_by_real_clients_without_proxy_variables() {
    if !root_or_skip("exec transparent") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let up = Upstreams::start();
    let cfg = up.config(true, WEB_POLICY);
    let m = marker("clients");
    let ca = up.ca.ca_pem.display();
    let script = format!(
        r#"
echo "curl-tls: $(curl -sS -m 10 --cacert {ca} https://app.test:18443/curl-{m})"
echo "curl-http: $(curl -sS -m 10 http://app.test:18080/curlhttp-{m})"
echo "curl-tls6: $(curl -6 -sS -m 10 --cacert {ca} https://app6.test:18443/curl6-{m})"
echo "python: $(python3 -c "import urllib.request,ssl; c=ssl.create_default_context(cafile='{ca}'); print(urllib.request.urlopen('https://app.test:18443/py-{m}', context=c, timeout=10).read().decode().strip())")"
echo "node: $(NODE_EXTRA_CA_CERTS={ca} node -e "fetch('https://app.test:18443/node-{m}').then(r=>r.text()).then(t=>process.stdout.write(t.trim())).catch(e=>{{console.error(String(e.cause||e));process.exit(1)}})")"
echo "wget: $(busybox wget -q -O - http://app.test:18080/wget-{m})"
echo "self: $(curl -sS -m 10 http://egress.internal/v1/self)"
"#
    );
    let out = run_confined(&cfg, "web", &script);
    // The agent's own name, without a proxy: its DNS answers the endpoint (127.0.0.1 here), the
    // kernel sends port 80 there to the command's transparent listener, the Host routes it.
    let me = out
        .lines()
        .find_map(|l| l.strip_prefix("self: "))
        .and_then(|j| serde_json::from_str::<serde_json::Value>(j).ok())
        .unwrap_or(serde_json::Value::Null);
    assert_eq!(me["policy"].as_str(), Some("web"), "{out}");
    for (line, tag, server, path) in [
        ("curl-tls:", "tls", &up.tls, "curl-"),
        ("curl-http:", "http", &up.http, "curlhttp-"),
        ("curl-tls6:", "tls6", &up.tls6, "curl6-"),
        ("python:", "tls", &up.tls, "py-"),
        ("node:", "tls", &up.tls, "node-"),
        ("wget:", "http", &up.http, "wget-"),
    ] {
        assert!(
            out.contains(&format!("{line} upstream-ok {tag}")),
            "{line} expected the upstream's answer:\n{out}"
        );
        assert!(
            server.saw(&format!("{path}{m}")),
            "{line}: the request did not arrive at the upstream: {:?}\n{out}",
            server.hits()
        );
    }
    // Names were resolved by the agent (its upstream saw them), not by anything else.
    assert!(up.dns.queries_for("app.test") > 0, "{}", up.dns.log());
    assert_enforcement_intact("after transparent clients");
}

#[test]
fn what_the_policy_refuses_reaches_nothing() {
    if !root_or_skip("exec transparent") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let up = Upstreams::start();
    // No IPv6 endpoint: IPv6 has no transparent listener and stays refused.
    let cfg = up.config(false, WEB_POLICY);
    let public = Canary::on(
        &[addr(&format!("{PUBLIC_A}:18080"))],
        &[addr(&format!("{PUBLIC_A}:18443"))],
    );
    let m = marker("refused");
    let ca = up.ca.ca_pem.display();
    let endpoint = cfg.endpoint_port;
    let script = format!(
        r#"
echo "sni: $(curl -sS -m 10 --cacert {ca} --resolve other.test:18443:127.0.0.1 https://other.test:18443/sni-{m} 2>&1)"
echo "host: $(curl -sS -m 10 --resolve other.test:18080:127.0.0.1 http://other.test:18080/host-{m} 2>&1)"
echo "nosni: $(curl -sS -m 10 -k https://127.0.0.1:18443/nosni-{m} 2>&1)"
echo "iplit: $(curl -sS -m 10 http://{PUBLIC_A}:18080/iplit-{m} 2>&1)"
echo "port: $(curl -sS -m 10 http://app.test:18081/port-{m} 2>&1)"
echo "nov6: $(curl -6 -sS -m 10 --cacert {ca} https://app6.test:18443/nov6-{m} 2>&1)"
echo "lying-dns: $(curl -sS -m 10 --cacert {ca} --resolve app.test:18443:127.0.0.2 https://app.test:18443/lying-{m} 2>&1)"
echo "proxied-port: $(curl -sS -m 10 -x http://127.0.0.1:{endpoint} -o /dev/null -w '%{{http_code}}' http://app.test:9/proxied-{m} 2>&1)"
python3 -c "import socket
s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)
try:
    s.sendto(b'quic-{m}',('{PUBLIC_A}',18443)); print('quic: sent')
except OSError as e:
    print('quic: refused', e.errno)"
"#
    );
    let out = run_confined(&cfg, "web", &script);
    for (line, server, path) in [
        ("sni:", &up.tls, "sni-"),
        ("host:", &up.http, "host-"),
        ("nosni:", &up.tls, "nosni-"),
        ("port:", &up.http_other_port, "port-"),
        ("nov6:", &up.tls6, "nov6-"),
    ] {
        assert!(
            !out.contains(&format!("{line} upstream-ok")),
            "{line} must be refused:\n{out}"
        );
        assert!(
            !server.saw(&format!("{path}{m}")),
            "{line}: a refused request arrived: {:?}",
            server.hits()
        );
    }
    // An HTTP refusal is an answer from the proxy, naming the reason.
    assert!(
        out.contains("host: ") && !out.contains("host: upstream-ok"),
        "{out}"
    );
    // A name the policy allows, sent to another address: the proxy dials the name (the real
    // upstream answers), never the address the client chose.
    assert!(out.contains("lying-dns: upstream-ok tls"), "{out}");
    assert!(up.tls.saw(&format!("lying-{m}")), "{:?}", up.tls.hits());
    assert!(
        !up.evil.saw(&m),
        "the lying address got a request: {:?}",
        up.evil.hits()
    );
    // Through the explicit listener (the proxy variables exec sets), a port the policy doesn't
    // list: 403, and the event names the entry that matched the name.
    assert!(out.contains("proxied-port: 403"), "{out}");
    assert!(
        out.lines().any(|l| l.contains("port-not-allowed")
            && l.contains("app.test")
            && l.contains("allow_hosts app.test")),
        "no port-not-allowed event naming its rule:\n{out}"
    );
    // An IP literal on an allowed port: refused (no name), nothing at the address.
    assert!(!out.contains("iplit: upstream-ok"), "{out}");
    // UDP to an allowed port (QUIC) is not intercepted: refused in the kernel.
    assert!(
        out.contains("quic: refused 1"),
        "UDP/443 must be refused with EPERM:\n{out}"
    );
    std::thread::sleep(Duration::from_millis(200));
    assert!(!public.saw(&m), "something reached the public address");
    assert_eq!(
        public.accepts(),
        0,
        "a TCP connection reached the public address"
    );
    assert_enforcement_intact("after transparent refusals");
}

#[test]
fn names_not_allowed_never_reach_a_resolver() {
    if !root_or_skip("exec dns") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let up = Upstreams::start();
    let cfg = up.config(false, WEB_POLICY);
    let m = marker("leak").to_ascii_lowercase();
    let script = format!(
        r#"
getent hosts glibc-{m}.test; echo "glibc: $?"
echo "dig-udp: $(dig +short +tries=1 +time=3 @192.0.2.53 digudp-{m}.test; dig +tries=1 +time=3 @192.0.2.53 digudp-{m}.test | grep -o 'status: [A-Z]*')"
echo "dig-tcp: $(dig +tcp +tries=1 +time=3 @192.0.2.53 digtcp-{m}.test | grep -o 'status: [A-Z]*')"
echo "nslookup: $(busybox nslookup bbox-{m}.test 192.0.2.53 2>&1 | tr '\n' ' ')"
echo "python: $(python3 -c "import socket
try:
    socket.getaddrinfo('py-{m}.test', 80); print('resolved')
except socket.gaierror as e:
    print('gaierror', e.errno)")"
echo "own-resolver: $(dig +tries=1 +time=2 @127.0.0.1 -p 15353 direct-{m}.test 2>&1 | tr '\n' ' ')"
echo "allowed-glibc: $(getent hosts app.test)"
echo "allowed-dig: $(dig +short +tries=1 +time=3 @192.0.2.53 app.test)"
echo "allowed-tcp: $(dig +tcp +short +tries=1 +time=3 @192.0.2.53 app.test)"
"#
    );
    let out = run_confined(&cfg, "web", &script);
    assert!(
        out.contains("glibc: 2"),
        "getent must fail (NXDOMAIN):\n{out}"
    );
    assert!(out.contains("dig-udp: status: NXDOMAIN"), "{out}");
    assert!(out.contains("dig-tcp: status: NXDOMAIN"), "{out}");
    assert!(
        out.contains("gaierror -2"),
        "python must get EAI_NONAME:\n{out}"
    );
    // (`own-resolver`: the agent's upstream on loopback is not reachable directly either; its
    // query log below shows nothing arrived.)
    // The answers of allowed names come back from the address the client asked (recvmsg puts
    // the server's address back) for glibc, dig over UDP and TCP.
    assert!(out.contains("allowed-glibc: 127.0.0.1"), "{out}");
    assert!(out.contains("allowed-dig: 127.0.0.1"), "{out}");
    assert!(out.contains("allowed-tcp: 127.0.0.1"), "{out}");
    // The allowed name reached the agent's resolver; no denied label did, by any path.
    assert!(
        up.dns.wait_query("app.test", Duration::from_secs(5)),
        "{}",
        up.dns.log()
    );
    assert_eq!(
        up.dns.queries_for(&m),
        0,
        "a denied name reached the resolver:\n{}",
        up.dns.log()
    );
    assert_enforcement_intact("after dns");
}

#[test]
fn dns_answers_open_direct_ports_for_their_ttl_only() {
    if !root_or_skip("exec dns direct ports") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let up = Upstreams::start();
    let cfg = up.config(false, WEB_POLICY);
    let canary = Canary::on(
        &[
            addr(&format!("{PUBLIC_A}:2222")),
            addr(&format!("{PUBLIC_A}:2223")),
            addr(&format!("{PUBLIC_B}:2222")),
        ],
        &[],
    );
    let m = marker("direct");
    let go = up.dir.path().join("go");
    let expired_loop = format!(
        "i=0; while [ $i -lt 40 ]; do r=$({}); echo \"$r\"; case \"$r\" in ERR*) echo EXPIRED; break;; esac; i=$((i+1)); sleep 0.5; done",
        tcp_send(PUBLIC_A, 2222, &format!("expired-{m}-$i"))
    );
    let script = format!(
        "{before}\ngetent hosts direct.test\n{after}\n{other_port}\n{other_addr}\necho READY\nwhile [ ! -e {go} ]; do sleep 0.05; done\n{expired_loop}\n",
        before = tcp_send(PUBLIC_A, 2222, &format!("before-{m}")),
        after = tcp_send(PUBLIC_A, 2222, &format!("after-{m}")),
        other_port = tcp_send(PUBLIC_A, 2223, &format!("otherport-{m}")),
        other_addr = tcp_send(PUBLIC_B, 2222, &format!("otheraddr-{m}")),
        go = go.display(),
    );
    let script = format!("unset HTTP_PROXY HTTPS_PROXY http_proxy https_proxy\n{script}");
    let mut a = exec_cmd("web", Some(&cfg.path))
        .args(["sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("exec A");
    let mut lines = BufReader::new(a.stdout.take().expect("stdout")).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.expect("line");
        seen.push(line.clone());
        if line == "READY" {
            break;
        }
    }
    // Another command (its own cgroup) with the same policy: the answer was not given to it.
    let b = run_confined(
        &cfg,
        "web",
        &tcp_send(PUBLIC_A, 2222, &format!("othercgroup-{m}")),
    );
    std::fs::write(&go, "").expect("go");
    for line in lines {
        seen.push(line.expect("line"));
    }
    a.wait().ok();
    let text = seen.join("\n");
    assert!(
        text.contains(&format!("ERR before-{m} 1")),
        "before the answer: EPERM\n{text}"
    );
    assert!(text.contains(PUBLIC_A), "getent answered:\n{text}");
    assert!(
        text.contains(&format!("OK after-{m}")),
        "after the answer: connected\n{text}"
    );
    assert!(text.contains(&format!("ERR otherport-{m} 1")), "{text}");
    assert!(text.contains(&format!("ERR otheraddr-{m} 1")), "{text}");
    assert!(b.contains(&format!("ERR othercgroup-{m} 1")), "{b}");
    assert!(
        text.contains("EXPIRED"),
        "the allowance must end with the TTL:\n{text}"
    );
    assert!(canary.wait_for(&format!("after-{m}"), Duration::from_secs(3)));
    for refused in ["before", "otherport", "otheraddr", "othercgroup"] {
        assert!(
            !canary.saw(&format!("{refused}-{m}")),
            "{refused}: arrived at the canary"
        );
    }
    // The attempt that found the allowance expired sent nothing.
    let last = text
        .lines()
        .filter_map(|l| l.strip_prefix("ERR "))
        .rfind(|l| l.starts_with("expired-"))
        .and_then(|l| l.split(' ').next())
        .expect("an expired attempt")
        .to_owned();
    assert!(!canary.saw(&last), "{last} arrived after the TTL");
    assert_enforcement_intact("after direct ports");
}

/// A run's identity under exec (`--label egress.run=…`, issue #41 item 4): the command's
/// refusals tell it its run (the 403's body) and its events carry the labels, as a container's
/// do; a label that isn't context is refused before anything runs.
#[test]
fn exec_labels_name_the_run_in_refusals_and_events() {
    if !root_or_skip("exec labels") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let up = Upstreams::start();
    let cfg = up.config(false, WEB_POLICY);
    let m = marker("label");
    let script = format!(
        "curl -sS -m 10 -x http://127.0.0.1:{} http://nowhere.test:18080/{m}",
        cfg.endpoint_port
    );
    let out = Command::new(egress_tests::agent::agent_bin())
        .args(["exec", "--policy", "web", "--config"])
        .arg(&cfg.path)
        .args([
            "--label",
            "egress.run=4711",
            "--label",
            "egress.repo=org/app",
        ])
        .args(["--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .output()
        .expect("run egress-agent exec");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        stdout.contains("egress-agent: denied by policy web: host-not-allowed")
            && stdout.contains("destination: nowhere.test:18080")
            && stdout.contains("run: 4711"),
        "the 403's body:\n{stdout}\n{stderr}"
    );
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("host-not-allowed") && l.contains("4711") && l.contains("org/app")),
        "no denial event with the run's labels:\n{stderr}"
    );
    // Not a context label: refused before the command runs.
    let flag = up.dir.path().join(format!("ran-{m}"));
    let out = Command::new(egress_tests::agent::agent_bin())
        .args(["exec", "--policy", "web", "--config"])
        .arg(&cfg.path)
        .args(["--label", "egress.policy=allow_all", "--", "touch"])
        .arg(&flag)
        .stdin(Stdio::null())
        .output()
        .expect("run egress-agent exec");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--label egress.policy: exec takes its policy from --policy"),
        "{stderr}"
    );
    assert!(!flag.exists(), "the command ran");
}

#[test]
fn an_auditing_policy_lets_everything_through_and_reports_it() {
    if !root_or_skip("exec audit") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let up = Upstreams::start();
    let cfg = up.config(
        false,
        "[policies.watch]\nenforce = \"audit\"\nallow_hosts = [\"app.test\"]\nallow_ports = [18080]\nresolve_private = [\"127.0.0.0/8\"]\n",
    );
    let canary = Canary::on(&[addr(&format!("{PUBLIC_A}:2223"))], &[]);
    let m = marker("audit");
    let script = format!(
        "echo \"dns: $(getent hosts audited.test)\"\n{}\n",
        tcp_send(PUBLIC_A, 2223, &format!("direct-{m}"))
    );
    let out = run_confined(&cfg, "watch", &script);
    assert!(
        out.contains(&format!("dns: {PUBLIC_A}")),
        "a name outside allow_hosts is answered under audit:\n{out}"
    );
    assert!(out.contains(&format!("OK direct-{m}")), "{out}");
    assert!(canary.wait_for(&format!("direct-{m}"), Duration::from_secs(3)));
    // Both are reported as would-deny: the name by the DNS responder, the connection by the
    // kernel.
    let would = out
        .lines()
        .filter(|l| l.contains("would-deny"))
        .collect::<Vec<_>>();
    assert!(
        would.iter().any(|l| l.contains("audited.test")),
        "no would-deny for the name:\n{out}"
    );
    assert!(
        would
            .iter()
            .any(|l| l.contains(PUBLIC_A) && l.contains("2223")),
        "no kernel would-deny for the connection:\n{out}"
    );
}

/// Not a test of the agent: the fixtures work without it (the positive control of the tests
/// above — a refusal can't be mistaken for a broken fixture).
#[test]
fn fixtures_answer_outside_the_agent() {
    if !root_or_skip("exec transparent fixtures") {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let up = Upstreams::start();
    let canary = Canary::on(&[addr(&format!("{PUBLIC_A}:2222"))], &[]);
    let m = marker("fixture");
    let out = Command::new("sh")
        .args([
            "-c",
            &format!(
                "curl -sS -m 5 --cacert {} --resolve other.test:18443:127.0.0.1 https://other.test:18443/{m}; dig +short @127.0.0.1 -p 15353 direct.test; {}",
                up.ca.ca_pem.display(),
                tcp_send(PUBLIC_A, 2222, &m)
            ),
        ])
        .output()
        .expect("sh");
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(out.contains("upstream-ok tls"), "{out}");
    assert!(out.contains(PUBLIC_A), "{out}");
    assert!(out.contains(&format!("OK {m}")), "{out}");
    assert!(canary.wait_for(&m, Duration::from_secs(3)));
}
