//! The real-client matrix (issue #40 item 8): package managers and HTTP clients as people run
//! them — pip, npm (with a global `cafile`, as corporate hosts have), cargo, go, apt-get, git
//! (clone and push), node `fetch`, python `urllib`, curl — each against local TLS registries the
//! test builds ([`egress_tests::registries`]), under `egress-agent exec` and in a Docker
//! container of a real daemon, over every path:
//!
//! - **explicit**: the proxy variables (`exec` sets them; in Docker, `egress-agent wire`'s flags);
//!   **transparent**: none, the client resolves the fixture's name (the agent's DNS answers) and
//!   connects, the kernel redirects it to the transparent listener;
//! - **pass-through**: the policy only allows the hosts, TLS is tunnelled, the client trusts the
//!   fixture's CA through its own setting (`PIP_CERT`, npm's `cafile`, `CARGO_HTTP_CAINFO`, …);
//!   **intercepted**: the policy binds a credential to every fixture host (a header with no
//!   placeholder, so the agent adds it to every request), so the agent terminates TLS and the
//!   client must trust the agent's CA — under `exec` through the variables `exec` sets, in Docker
//!   through exactly what `egress-agent wire` prints.
//!
//! Each run checks that the client succeeded, that the artefact it downloaded has the sha256 of
//! what the fixture served (for git: the commit and file of the clone, and for a push that the
//! fixture repository received the pushed commit), that its requests arrived at the fixture, and
//! that they carried the agent's header exactly when the policy intercepts (every request, or
//! none). One agent (or daemon) per runtime, one set of fixtures, every client in a table-driven
//! loop; failures are collected and reported together with each failing client's output. Nothing
//! leaves the machine: the fixtures listen on loopback or in the test's own namespace.
//!
//! The explicit runs use twins of the policies with `transparent = false`, so a client that
//! ignored the proxy variables could not pass for one that used them. Known limits (also in
//! docs/development.md): node 20's `fetch` ignores the proxy variables, so its explicit rows check
//! that it is refused and nothing of it arrives (it works only transparently); apt reads no CA
//! variable, so under `exec` with interception it is pointed at
//! `$SSL_CERT_FILE` (in Docker, `wire`'s bundle mounted over the default bundle covers it).
use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use egress_tests::agent::{TestConfig, agent_bin};
use egress_tests::registries::{self, Fixtures, Hit, NAMES, RegistryServer, TOKEN_HEADER};
use egress_tests::root_or_skip;
use egress_tests::upstreams::{TempDir, TestCa};

/// The value the intercepting policy's binding adds (never seen by a client).
const TOKEN: &str = "fixture-token-7Hq2Xv9Lm4";

/// Where a client's output lands: `$W/artefact` (compared with a fixture artefact), plus
/// `$W/head` for git (the commit of the clone, or the pushed one).
struct Client {
    name: &'static str,
    /// The fixture name it talks to (one per client: its requests are told apart by it).
    host: &'static str,
    /// The key of [`Fixtures::sha256`] its `artefact` must match.
    artefact: &'static str,
    /// `sh` script, run in `$W` with `set -e`. `$P` is the fixture port, `$RUN` the run's label.
    script: &'static str,
    /// Why the explicit path does not apply, when the client ignores the proxy variables.
    ignores_proxy: Option<&'static str>,
}

const CLIENTS: &[Client] = &[
    Client {
        name: "curl",
        host: "curl.fixture.test",
        artefact: "blob",
        script: r#"curl -sS --fail --max-time 60 -o artefact "https://curl.fixture.test:$P/files/blob.bin""#,
        ignores_proxy: None,
    },
    Client {
        name: "python-urllib",
        host: "py.fixture.test",
        artefact: "blob",
        script: r#"/usr/bin/python3 -c 'import sys, urllib.request; open("artefact", "wb").write(urllib.request.urlopen(sys.argv[1], timeout=60).read())' "https://py.fixture.test:$P/files/blob.bin""#,
        ignores_proxy: None,
    },
    Client {
        name: "node-fetch",
        host: "node.fixture.test",
        artefact: "blob",
        script: r#"/usr/bin/node -e 'fetch(process.argv[1]).then(async r => { if (!r.ok) throw new Error("HTTP " + r.status); require("fs").writeFileSync("artefact", Buffer.from(await r.arrayBuffer())) }).catch(e => { console.error(e.cause || e); process.exit(1) })' "https://node.fixture.test:$P/files/blob.bin""#,
        ignores_proxy: Some("node 20's fetch ignores the proxy variables"),
    },
    Client {
        name: "pip",
        host: "pypi.fixture.test",
        artefact: "wheel",
        script: r#"PIP_CONFIG_FILE=/dev/null /usr/bin/python3 -m pip download --no-deps --no-cache-dir --disable-pip-version-check --retries 0 --timeout 60 --index-url "https://pypi.fixture.test:$P/simple/" -d . egress-fixture-py==0.1.0
cp egress_fixture_py-0.1.0-py3-none-any.whl artefact"#,
        ignores_proxy: None,
    },
    Client {
        name: "npm",
        host: "npm.fixture.test",
        artefact: "npm-tgz",
        script: r#"echo "global cafile: $(npm config get cafile)"
npm pack egress-fixture-npm@1.0.0 --registry "https://npm.fixture.test:$P/npm/" --cache "$W/cache" --pack-destination "$W" --fetch-retries=0 --update-notifier=false --audit=false --fund=false
cp egress-fixture-npm-1.0.0.tgz artefact"#,
        ignores_proxy: None,
    },
    Client {
        name: "cargo",
        host: "crates.fixture.test",
        artefact: "crate",
        script: r#"mkdir -p home proj/src
printf '[registries.fixture]\nindex = "sparse+https://crates.fixture.test:%s/cargo/index/"\n[net]\nretry = 0\n' "$P" > home/config.toml
printf '[package]\nname = "client"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\negressfixture = { version = "0.1.0", registry = "fixture" }\n' > proj/Cargo.toml
: > proj/src/lib.rs
CARGO_HOME="$W/home" "$CARGO_BIN" fetch --manifest-path proj/Cargo.toml
cp home/registry/cache/*/egressfixture-0.1.0.crate artefact"#,
        ignores_proxy: None,
    },
    Client {
        name: "go",
        host: "go.fixture.test",
        artefact: "go-zip",
        script: r#"mkdir -p mod && cd mod
printf 'module client.test/m\n\ngo 1.19\n\nrequire fixture.test/egt v0.1.0\n' > go.mod
export GOPROXY="https://go.fixture.test:$P/go" GOSUMDB=off GONOSUMDB='*' GOFLAGS=-mod=mod GO111MODULE=on GOTOOLCHAIN=local GOPATH="$W/gopath" GOMODCACHE="$W/gopath/pkg/mod" GOCACHE="$W/gocache"
go mod download -json fixture.test/egt
cp "$W/gopath/pkg/mod/cache/download/fixture.test/egt/@v/v0.1.0.zip" "$W/artefact""#,
        ignores_proxy: None,
    },
    Client {
        name: "apt",
        host: "apt.fixture.test",
        artefact: "deb",
        script: r#"mkdir -p state/lists/partial cache/archives/partial etc/empty
echo "deb [trusted=yes] https://apt.fixture.test:$P/apt ./" > etc/sources.list
: > status
cat > apt.conf <<EOF
Dir::Etc::main "/dev/null";
Dir::Etc::parts "$W/etc/empty";
Dir::Etc::SourceList "$W/etc/sources.list";
Dir::Etc::SourceParts "$W/etc/empty";
Dir::Etc::Preferences "/dev/null";
Dir::Etc::PreferencesParts "$W/etc/empty";
Dir::State "$W/state";
Dir::State::status "$W/status";
Dir::Cache "$W/cache";
APT::Sandbox::User "root";
Debug::NoLocking "true";
Acquire::Retries "0";
Acquire::Languages "none";
EOF
export APT_CONFIG="$W/apt.conf"
apt-get -q ${APT_CAINFO:+-o Acquire::https::CAInfo="$APT_CAINFO"} update
apt-get -q ${APT_CAINFO:+-o Acquire::https::CAInfo="$APT_CAINFO"} download egress-fixture-deb
cp egress-fixture-deb_1.0_all.deb artefact"#,
        ignores_proxy: None,
    },
    Client {
        name: "git-clone",
        host: "git.fixture.test",
        artefact: "git-file",
        script: r#"/usr/bin/git clone -q "https://git.fixture.test:$P/git/fixture.git" clone
/usr/bin/git -C clone rev-parse HEAD > head
cp clone/hello.txt artefact"#,
        ignores_proxy: None,
    },
    Client {
        name: "git-push",
        host: "gitpush.fixture.test",
        artefact: "git-file",
        script: r#"/usr/bin/git clone -q "https://gitpush.fixture.test:$P/git/fixture.git" clone
cp clone/hello.txt artefact
cd clone
echo "$RUN" > pushed.txt
/usr/bin/git add pushed.txt
/usr/bin/git commit -q -m "pushed by $RUN"
/usr/bin/git push -q origin "HEAD:refs/heads/$RUN"
/usr/bin/git rev-parse HEAD > ../head"#,
        ignores_proxy: None,
    },
];

/// What every client gets: a private HOME, git without the host's configuration, a PATH that
/// holds the real cargo. `$OUT` is the run's directory, `$FIX` the test's configuration files.
const DRIVER_HEAD: &str = r#"set -u
export HOME="$OUT/home" PATH="$CARGO_DIR:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_TERMINAL_PROMPT=0
export GIT_AUTHOR_NAME=client GIT_AUTHOR_EMAIL=client@fixture.test GIT_COMMITTER_NAME=client GIT_COMMITTER_EMAIL=client@fixture.test
export CARGO_BIN="$CARGO_DIR/cargo"
mkdir -p "$HOME"
if [ "${TRANSPARENT:-}" = 1 ]; then
    unset HTTP_PROXY HTTPS_PROXY http_proxy https_proxy ALL_PROXY all_proxy NO_PROXY no_proxy
fi
# apt reads no CA variable: point it at the bundle the run was given.
if [ "${APT_CAINFO:-}" = from-ssl-cert-file ]; then export APT_CAINFO="$SSL_CERT_FILE"; fi
echo "proxy: ${HTTPS_PROXY:-none}" > "$OUT/env"
env | sort >> "$OUT/env"
"#;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Pass,
    Intercept,
}

impl Mode {
    /// The policy of a run: the `_x` twins have `transparent = false`, so only the proxy
    /// variables lead out (a client that ignores them is refused, not carried transparently).
    fn policy(self, transparent: bool) -> &'static str {
        match (self, transparent) {
            (Mode::Pass, true) => "pass",
            (Mode::Pass, false) => "pass_x",
            (Mode::Intercept, true) => "icpt",
            (Mode::Intercept, false) => "icpt_x",
        }
    }
    fn label(self) -> &'static str {
        match self {
            Mode::Pass => "pass-through",
            Mode::Intercept => "intercepted",
        }
    }
}

/// The test's files: the fixtures, the CA, the client scripts and the runs' directories.
struct Setup {
    _dir: TempDir,
    base: PathBuf,
    fx: Fixtures,
    ca: TestCa,
    /// `ca.pem`, `npmrc` (global, `cafile` = the fixture CA), `userrc` (empty), `driver.sh`.
    cfg: PathBuf,
    cargo_dir: PathBuf,
}

impl Setup {
    fn new(what: &str, port: u16) -> Setup {
        let dir = TempDir::new(what);
        let base = dir.path().to_owned();
        let cfg = base.join("cfg");
        std::fs::create_dir_all(cfg.join("clients")).expect("cfg dir");
        let ca = TestCa::new(&cfg, NAMES);
        let fx = Fixtures::build(&base.join("fixture"), port);
        // A "corporate" global npmrc naming the fixture CA (clients of both modes use it).
        std::fs::write(
            cfg.join("npmrc"),
            format!("cafile={}\n", ca.ca_pem.display()),
        )
        .expect("npmrc");
        std::fs::write(cfg.join("userrc"), "").expect("userrc");
        let mut driver = String::from(DRIVER_HEAD);
        for c in CLIENTS {
            let script = cfg.join("clients").join(format!("{}.sh", c.name));
            std::fs::write(&script, format!("set -e\n{}\n", c.script)).expect("client script");
            writeln!(
                driver,
                "mkdir -p \"$OUT/{n}\" && (cd \"$OUT/{n}\" && W=\"$OUT/{n}\" timeout 180 sh {s}) >\"$OUT/{n}.log\" 2>&1; echo $? > \"$OUT/{n}.rc\"",
                n = c.name,
                s = script.display()
            )
            .expect("write");
        }
        std::fs::write(cfg.join("driver.sh"), driver).expect("driver");
        // The real cargo of this toolchain (not rustup's proxy), whose directory a container
        // mounts as it is.
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_owned());
        let cargo_dir = Path::new(&cargo)
            .parent()
            .expect("cargo's directory")
            .to_owned();
        sh_chmod(&base);
        Setup {
            _dir: dir,
            base,
            fx,
            ca,
            cfg,
            cargo_dir,
        }
    }

    /// A fresh directory for one run's output (`$OUT`).
    fn out(&self, label: &str) -> PathBuf {
        let out = self.base.join("runs").join(label);
        std::fs::create_dir_all(&out).expect("run dir");
        std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        out
    }

    /// Environment every run gets: where things are, npm's corporate configuration, and for a
    /// pass-through run each client's own setting naming the fixture CA.
    fn env(
        &self,
        out: &Path,
        run: &str,
        port: u16,
        mode: Mode,
        transparent: bool,
    ) -> Vec<(String, String)> {
        let cfg = self.cfg.display();
        let mut env = vec![
            ("OUT".to_owned(), out.display().to_string()),
            ("RUN".to_owned(), run.to_owned()),
            ("P".to_owned(), port.to_string()),
            ("CARGO_DIR".to_owned(), self.cargo_dir.display().to_string()),
            ("NPM_CONFIG_GLOBALCONFIG".to_owned(), format!("{cfg}/npmrc")),
            ("NPM_CONFIG_USERCONFIG".to_owned(), format!("{cfg}/userrc")),
            (
                "TRANSPARENT".to_owned(),
                if transparent { "1" } else { "0" }.to_owned(),
            ),
        ];
        if mode == Mode::Pass {
            let ca = self.ca.ca_pem.display().to_string();
            for v in [
                "SSL_CERT_FILE",
                "PIP_CERT",
                "CURL_CA_BUNDLE",
                "GIT_SSL_CAINFO",
                "CARGO_HTTP_CAINFO",
                "NODE_EXTRA_CA_CERTS",
                "APT_CAINFO",
            ] {
                env.push((v.to_owned(), ca.clone()));
            }
        }
        env
    }
}

/// Everything under `base` readable by any user (the command may run as another user).
fn sh_chmod(base: &Path) {
    egress_tests::sh(&format!("chmod -R a+rX {}", base.display()));
}

/// One row of the matrix.
struct Row {
    runtime: &'static str,
    mode: Mode,
    path: &'static str,
    client: &'static str,
    verdict: String,
}

/// One run of every client: a runtime, a mode and a path.
struct Run {
    runtime: &'static str,
    mode: Mode,
    transparent: bool,
    /// `exec-pass`, `docker-icpt_x`, … (also the branch git pushes to).
    label: String,
    /// The run's directory (`$OUT`).
    out: PathBuf,
    /// What the fixture received during the run.
    hits: Vec<Hit>,
}

/// After run `r`'s driver (`exec`, or `docker exec` in the run's container) ended as `o`: a
/// failed driver is a failure of its own, then every client is checked against what the
/// fixture received since `before`.
fn conclude(
    s: &Setup,
    server: &RegistryServer,
    before: usize,
    o: &Output,
    mut r: Run,
    rows: &mut Vec<Row>,
    failures: &mut Vec<String>,
) {
    if !o.status.success() {
        let driver = if r.runtime == "docker" {
            "docker exec"
        } else {
            "exec"
        };
        failures.push(format!(
            "== {}: {driver} failed ({}):\n{}{}",
            r.label,
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    r.hits = server.hits()[before..].to_vec();
    check_run(s, &r, rows, failures);
}

/// Check every client of one run: exit code, artefact hash, the fixture's record of its
/// requests and the agent's header on them.
fn check_run(s: &Setup, r: &Run, rows: &mut Vec<Row>, failures: &mut Vec<String>) {
    let Run {
        runtime,
        mode,
        transparent,
        ref label,
        ref out,
        ref hits,
    } = *r;
    let run = label.as_str();
    let path = if transparent {
        "transparent"
    } else {
        "explicit"
    };
    for c in CLIENTS {
        if let (false, Some(why)) = (transparent, c.ignores_proxy) {
            // With `transparent = false` such a client has no way out: it must fail, and
            // nothing of it may arrive.
            let rc =
                std::fs::read_to_string(out.join(format!("{}.rc", c.name))).unwrap_or_default();
            let arrived = hits.iter().filter(|h| h.name() == c.host).count();
            let verdict = if rc.trim() != "0" && !rc.trim().is_empty() && arrived == 0 {
                format!("n/a: {why} (refused, nothing arrived)")
            } else {
                failures.push(format!(
                    "== {runtime} {} explicit {}: expected a refusal ({why}), got exit {} and {arrived} requests",
                    mode.label(),
                    c.name,
                    rc.trim()
                ));
                format!(
                    "FAILED: not refused (exit {}, {arrived} requests)",
                    rc.trim()
                )
            };
            rows.push(Row {
                runtime,
                mode,
                path: "explicit",
                client: c.name,
                verdict,
            });
            continue;
        }
        let dir = out.join(c.name);
        let log = std::fs::read_to_string(out.join(format!("{}.log", c.name))).unwrap_or_default();
        let rc = std::fs::read_to_string(out.join(format!("{}.rc", c.name)))
            .unwrap_or_else(|_| "never ran".to_owned());
        let mine: Vec<&Hit> = hits.iter().filter(|h| h.name() == c.host).collect();
        let mut problems = Vec::new();
        if rc.trim() != "0" {
            problems.push(format!("exit {}", rc.trim()));
        }
        let want = &s.fx.sha256[c.artefact];
        match std::fs::read(dir.join("artefact")) {
            Ok(got) => {
                let got = registries::sha256_hex(&got);
                if &got != want {
                    problems.push(format!("artefact sha256 {got}, the fixture served {want}"));
                }
            }
            Err(_) => problems.push("no artefact".to_owned()),
        }
        let head = std::fs::read_to_string(dir.join("head")).unwrap_or_default();
        let head = head.trim();
        match c.name {
            "git-clone" if head != s.fx.git_head => {
                problems.push(format!(
                    "cloned {head:?}, the fixture has {}",
                    s.fx.git_head
                ));
            }
            "git-push" => match s.fx.git_branch(run) {
                Some(b) if !head.is_empty() && b == head => {}
                other => problems.push(format!(
                    "pushed {head:?}, the fixture's branch {run} is {other:?}"
                )),
            },
            _ => {}
        }
        if !mine.iter().any(|h| h.status == 200) {
            problems.push(format!(
                "no successful request arrived at {} ({} requests)",
                c.host,
                mine.len()
            ));
        }
        let tokened = mine
            .iter()
            .filter(|h| h.token.as_deref() == Some(TOKEN))
            .count();
        match mode {
            Mode::Intercept if tokened != mine.len() => problems.push(format!(
                "intercepted, but {} of {} requests lack the agent's {TOKEN_HEADER}: {:?}",
                mine.len() - tokened,
                mine.len(),
                mine.iter()
                    .filter(|h| h.token.is_none())
                    .map(|h| format!("{} {}", h.method, h.path))
                    .collect::<Vec<_>>()
            )),
            Mode::Pass if mine.iter().any(|h| h.token.is_some()) => {
                problems.push(format!("pass-through, but {TOKEN_HEADER} arrived"));
            }
            _ => {}
        }
        let label = format!("{runtime} {} {path} {}", mode.label(), c.name);
        if problems.is_empty() {
            rows.push(Row {
                runtime,
                mode,
                path,
                client: c.name,
                verdict: format!("ok, {} requests", mine.len()),
            });
        } else {
            rows.push(Row {
                runtime,
                mode,
                path,
                client: c.name,
                verdict: format!("FAILED: {}", problems.join("; ")),
            });
            failures.push(format!(
                "== {label}: {}\n-- output --\n{}",
                problems.join("; "),
                tail(&log, 40)
            ));
        }
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn report(rows: &[Row], failures: &[String], started: Instant) {
    let mut t =
        String::from("| runtime | mode | path | client | result |\n|---|---|---|---|---|\n");
    for r in rows {
        writeln!(
            t,
            "| {} | {} | {} | {} | {} |",
            r.runtime,
            r.mode.label(),
            r.path,
            r.client,
            r.verdict
        )
        .expect("write");
    }
    eprintln!("{t}\n({} runs in {:.0?})", rows.len(), started.elapsed());
    assert!(
        failures.is_empty(),
        "{} of {} client runs failed:\n{}\n\n{t}",
        failures.len(),
        rows.len(),
        failures.join("\n\n")
    );
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port()
}

/// The agent's policies, shared by both runtimes: `pass` allows the fixture names on the
/// fixture's port; `icpt` does too and binds a credential (header, no placeholder) to all of
/// them, so the agent terminates TLS for them and adds the header to every request. Their `_x`
/// twins (the explicit runs) have `transparent = false`.
fn policies(port: u16, private: &str, token_file: &Path) -> String {
    let mut out = String::new();
    for mode in [Mode::Pass, Mode::Intercept] {
        for transparent in [true, false] {
            let name = mode.policy(transparent);
            writeln!(
                out,
                "[policies.{name}]\nallow_hosts = [\"*.fixture.test\"]\nallow_ports = [{port}]\n\
                 resolve_private = [\"{private}\"]\ntransparent = {transparent}"
            )
            .expect("write");
            if mode == Mode::Intercept {
                writeln!(
                    out,
                    "[[policies.{name}.credentials]]\nhost = \"*.fixture.test\"\nport = {port}\n\
                     header = \"{TOKEN_HEADER}\"\nsource = {{ file = \"{}\" }}",
                    token_file.display()
                )
                .expect("write");
            }
            out.push('\n');
        }
    }
    out
}

#[test]
fn real_clients_under_exec() {
    if !root_or_skip("real clients under exec") {
        return;
    }
    let started = Instant::now();
    let port = free_port();
    let s = Setup::new("real-clients-exec", port);
    let server = RegistryServer::start(
        &s.fx,
        &s.ca,
        format!("127.0.0.1:{port}").parse().expect("addr"),
        None,
    );
    let agent = s.base.join("agent");
    let state = agent.join("state");
    std::fs::create_dir_all(&state).expect("state");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let token = state.join("token");
    std::fs::write(&token, TOKEN).expect("token");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let hosts: String = NAMES.iter().map(|n| format!("127.0.0.1 {n}\n")).collect();
    std::fs::write(agent.join("hosts"), hosts).expect("hosts");
    let a = agent.display();
    let cfg = TestConfig::new(&format!(
        r#"connect_timeout_ms = 5000
[agent]
state_dir = "{a}/state"
[intercept]
upstream_ca_file = "{ca}"
[dns]
nameservers = []
hosts_file = "{a}/hosts"

{p}"#,
        ca = s.ca.ca_pem.display(),
        p = policies(port, "127.0.0.0/8", &token)
    ));
    let (mut rows, mut failures) = (Vec::new(), Vec::new());
    for mode in [Mode::Pass, Mode::Intercept] {
        for transparent in [false, true] {
            let run = format!("exec-{}", mode.policy(transparent));
            let out = s.out(&run);
            let mut env = s.env(&out, &run, port, mode, transparent);
            if mode == Mode::Intercept {
                env.push(("APT_CAINFO".to_owned(), "from-ssl-cert-file".to_owned()));
            }
            let mut cmd = Command::new(agent_bin());
            cmd.args(["exec", "--policy", mode.policy(transparent), "--config"])
                .arg(&cfg.path)
                .arg("--")
                .arg("sh")
                .arg(s.cfg.join("driver.sh"))
                .current_dir(&out);
            // Nothing of the test's own environment decides what the clients trust or where
            // they connect: only what `exec` and the run give them.
            for v in egress_agent::ca::trust::CA_VARIABLES {
                cmd.env_remove(v.name);
            }
            for v in [
                "HTTP_PROXY",
                "HTTPS_PROXY",
                "http_proxy",
                "https_proxy",
                "ALL_PROXY",
                "all_proxy",
                "NO_PROXY",
                "no_proxy",
                "CARGO_HOME",
                "RUSTUP_TOOLCHAIN",
            ] {
                cmd.env_remove(v);
            }
            let before = server.hits().len();
            let o = cmd
                .envs(env)
                .stdin(Stdio::null())
                .output()
                .expect("egress-agent exec");
            let r = Run {
                runtime: "exec",
                mode,
                transparent,
                label: run,
                out,
                hits: Vec::new(),
            };
            conclude(&s, &server, before, &o, r, &mut rows, &mut failures);
        }
    }
    report(&rows, &failures, started);
}

#[test]
fn real_clients_in_docker() {
    use egress_tests::docker::{Env, GATEWAY, SERIAL};
    if !egress_tests::docker::require_root() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let started = Instant::now();
    // Inside the private dockerd's namespace: a fixed port is free there.
    let port = 18_643;
    let s = Setup::new("real-clients-docker", port);
    let mut env = Env::new(&[Path::new("/usr/bin/curl")]);
    let server = RegistryServer::start(
        &s.fx,
        &s.ca,
        format!("{GATEWAY}:{port}").parse().expect("addr"),
        Some(&env.d.netns.name),
    );
    let token = env.dir.join("token");
    std::fs::write(&token, TOKEN).expect("token");
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let hosts = std::fs::read_to_string(env.dir.join("hosts")).expect("hosts");
    let more: String = NAMES.iter().map(|n| format!("{GATEWAY} {n}\n")).collect();
    std::fs::write(env.dir.join("hosts"), format!("{hosts}{more}")).expect("hosts");
    env.write_config(&env.config_text(&format!(
        "[intercept]\nupstream_ca_file = \"{}\"\n\n{}",
        s.ca.ca_pem.display(),
        policies(port, &format!("{GATEWAY}/32"), &token)
    )));
    // `[intercept]` is read at start.
    env.kill_agent();
    env.start_agent();
    let (mut rows, mut failures) = (Vec::new(), Vec::new());
    let runs = s.base.join("runs");
    std::fs::create_dir_all(&runs).expect("runs");
    for mode in [Mode::Pass, Mode::Intercept] {
        for transparent in [false, true] {
            let policy = mode.policy(transparent);
            // Exactly what `egress-agent wire POLICY` prints, then the host's /usr (the
            // clients), this toolchain (cargo and its rustc), the test's files and the runs' directory.
            let wired = Command::new(env.agent_bin())
                .args(["wire", policy, "--config"])
                .arg(env.config_path())
                .output()
                .expect("wire");
            let text = String::from_utf8_lossy(&wired.stdout).into_owned();
            assert!(wired.status.success(), "wire {policy}: {text}");
            let mut flags: Vec<String> = text
                .split_whitespace()
                .filter(|w| *w != "\\")
                .map(str::to_owned)
                .collect();
            for (dir, how) in [
                (Path::new("/usr"), "ro"),
                // The whole toolchain: cargo runs its rustc, which loads the toolchain's libraries.
                (s.cargo_dir.parent().expect("the toolchain"), "ro"),
                (s.cfg.as_path(), "ro"),
                (runs.as_path(), "rw"),
            ] {
                flags.push("-v".to_owned());
                flags.push(format!("{d}:{d}:{how}", d = dir.display()));
            }
            let name = format!("clients-{}", policy.replace('_', "-"));
            let f: Vec<&str> = flags.iter().map(String::as_str).collect();
            env.start_ok(&name, &f, &["sleep", "900"]);
            assert!(env.wait_enforced(&name, 1), "{}", env.log());
            assert!(
                env.wait_host_layer(&name),
                "host layer never enforced for {name}"
            );
            let run = format!("docker-{policy}");
            let out = s.out(&run);
            let mut args = vec!["exec".to_owned()];
            for (k, v) in s.env(&out, &run, port, mode, transparent) {
                args.push("-e".to_owned());
                args.push(format!("{k}={v}"));
            }
            args.push(name.clone());
            args.push("sh".to_owned());
            args.push(s.cfg.join("driver.sh").display().to_string());
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            let before = server.hits().len();
            let o = env.d.docker(&a);
            let r = Run {
                runtime: "docker",
                mode,
                transparent,
                label: run,
                out,
                hits: Vec::new(),
            };
            conclude(&s, &server, before, &o, r, &mut rows, &mut failures);
            env.d.docker(&["rm", "-f", &name]);
        }
    }
    report(&rows, &failures, started);
}
