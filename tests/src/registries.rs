//! Local package registries for the real-client matrix (`tests/tests/real_clients.rs`): one TLS
//! server (python3, a certificate for every fixture name from a CA the test generates) that
//! serves, each under its own name:
//!
//! | name | what | client |
//! | --- | --- | --- |
//! | `pypi.fixture.test` | a static simple index (`/simple/<project>/`) and a wheel | pip |
//! | `npm.fixture.test` | a static registry document and its tarball (`/npm/<name>`) | npm |
//! | `crates.fixture.test` | a sparse cargo index (`config.json`, index file) and a `.crate` | cargo |
//! | `go.fixture.test` | a GOPROXY module proxy (`/go/<module>/@v/…`: list, info, mod, zip) | go |
//! | `apt.fixture.test` | a flat apt repository (`Packages` from `dpkg-scanpackages`) and a `.deb` | apt-get |
//! | `git.fixture.test`, `gitpush.fixture.test` | `git http-backend` (CGI): clone and push | git |
//! | `curl.` / `py.` / `node.fixture.test` | a binary file | curl, python `urllib`, node `fetch` |
//!
//! Every request is recorded (name, method, path, status and the `x-fixture-token` header, which
//! only the agent adds: the intercepting policy binds it as a credential), so a test knows what
//! arrived and whether the agent terminated TLS on the way. The artefacts are built by the test
//! ([`Fixtures::build`]) and their sha256 kept, to compare with what each client downloaded.
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256, Sha512};

/// The fixture names (all in the server's certificate), one per client so each client's
/// requests can be told apart.
pub const NAMES: &[&str] = &[
    "pypi.fixture.test",
    "npm.fixture.test",
    "crates.fixture.test",
    "go.fixture.test",
    "apt.fixture.test",
    "git.fixture.test",
    "gitpush.fixture.test",
    "curl.fixture.test",
    "py.fixture.test",
    "node.fixture.test",
];

/// The header the intercepting policy's credential binding adds (no placeholder: always set).
pub const TOKEN_HEADER: &str = "x-fixture-token";

pub const PY_PROJECT: &str = "egress-fixture-py";
pub const NPM_PACKAGE: &str = "egress-fixture-npm";
pub const CRATE: &str = "egressfixture";
pub const GO_MODULE: &str = "fixture.test/egt";
pub const DEB_PACKAGE: &str = "egress-fixture-deb";

/// Hex sha256.
pub fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Hex sha256 of a file (panics if it can't be read).
pub fn sha256_file(path: &Path) -> String {
    sha256_hex(&std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display())))
}

/// The fixture tree: `root` (served files), `git` (bare repositories for `git http-backend`),
/// and what was served: artefact name → sha256.
pub struct Fixtures {
    pub root: PathBuf,
    pub git: PathBuf,
    /// `blob`, `wheel`, `npm-tgz`, `crate`, `go-zip`, `deb`, `git-file` → sha256.
    pub sha256: BTreeMap<&'static str, String>,
    /// The commit the fixture repository's `main` starts at.
    pub git_head: String,
}

fn write(path: &Path, data: impl AsRef<[u8]>) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("fixture dir");
    std::fs::write(path, data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// `python3 -c` building a zip from (name, text) pairs (wheels and Go module zips are zips).
fn zip(out: &Path, entries: &[(&str, String)]) {
    let spec = serde_json::to_string(&entries).expect("zip entries");
    let script = "import json, sys, zipfile\n\
        with zipfile.ZipFile(sys.argv[1], 'w', zipfile.ZIP_DEFLATED) as z:\n\
        \x20   for name, text in json.loads(sys.argv[2]):\n\
        \x20       z.writestr(name, text)\n";
    std::fs::create_dir_all(out.parent().expect("parent")).expect("dir");
    let st = Command::new("/usr/bin/python3")
        .args(["-c", script])
        .arg(out)
        .arg(spec)
        .status()
        .expect("python3 zip");
    assert!(st.success(), "zip {}", out.display());
}

impl Fixtures {
    /// Build every registry under `dir` for clients reaching the server as `https://<name>:<port>`.
    pub fn build(dir: &Path, port: u16) -> Fixtures {
        let root = dir.join("www");
        let git = dir.join("git");
        let build = dir.join("build");
        std::fs::create_dir_all(&build).expect("build dir");
        let mut sha256 = BTreeMap::new();

        // curl / python / node: a binary file (every byte value, some length).
        let blob: Vec<u8> = (0..200_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        write(&root.join("files/blob.bin"), &blob);
        sha256.insert("blob", sha256_hex(&blob));

        // pip: a wheel and the simple index page linking it (with its hash, which pip checks).
        let dist = PY_PROJECT.replace('-', "_");
        let wheel_name = format!("{dist}-0.1.0-py3-none-any.whl");
        let wheel = root.join("packages").join(&wheel_name);
        let metadata = format!("Metadata-Version: 2.1\nName: {PY_PROJECT}\nVersion: 0.1.0\n");
        let wheel_meta = "Wheel-Version: 1.0\nGenerator: egress-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n";
        zip(
            &wheel,
            &[
                (&format!("{dist}/__init__.py"), "VALUE = 1\n".to_owned()),
                (&format!("{dist}-0.1.0.dist-info/METADATA"), metadata),
                (
                    &format!("{dist}-0.1.0.dist-info/WHEEL"),
                    wheel_meta.to_owned(),
                ),
                (&format!("{dist}-0.1.0.dist-info/RECORD"), String::new()),
            ],
        );
        let wheel_sha = sha256_file(&wheel);
        write(
            &root.join(format!("simple/{PY_PROJECT}/_index.html")),
            format!(
                "<!DOCTYPE html><html><body>\n<a href=\"../../packages/{wheel_name}#sha256={wheel_sha}\">{wheel_name}</a>\n</body></html>\n"
            ),
        );
        write(
            &root.join("simple/_index.html"),
            format!(
                "<!DOCTYPE html><html><body><a href=\"{PY_PROJECT}/\">{PY_PROJECT}</a></body></html>\n"
            ),
        );
        sha256.insert("wheel", wheel_sha);

        // npm: the registry document (packument) and the tarball, with its integrity.
        let pkg = build.join("npm/package");
        write(
            &pkg.join("package.json"),
            format!("{{\"name\":\"{NPM_PACKAGE}\",\"version\":\"1.0.0\",\"main\":\"index.js\"}}\n"),
        );
        write(&pkg.join("index.js"), "module.exports = 1;\n");
        let tgz_name = format!("{NPM_PACKAGE}-1.0.0.tgz");
        let tgz = root.join(format!("npm/{NPM_PACKAGE}/-/{tgz_name}"));
        std::fs::create_dir_all(tgz.parent().expect("parent")).expect("dir");
        crate::sh(&format!(
            "tar -C {} -czf {} package",
            build.join("npm").display(),
            tgz.display()
        ));
        let tgz_bytes = std::fs::read(&tgz).expect("tgz");
        use base64::Engine as _;
        let integrity = format!(
            "sha512-{}",
            base64::engine::general_purpose::STANDARD.encode(Sha512::digest(&tgz_bytes))
        );
        let doc = serde_json::json!({
            "name": NPM_PACKAGE,
            "dist-tags": {"latest": "1.0.0"},
            "versions": {"1.0.0": {
                "name": NPM_PACKAGE,
                "version": "1.0.0",
                "main": "index.js",
                "dist": {
                    "tarball": format!("https://npm.fixture.test:{port}/npm/{NPM_PACKAGE}/-/{tgz_name}"),
                    "integrity": integrity,
                },
            }},
        });
        write(
            &root.join(format!("npm/{NPM_PACKAGE}/_index.json")),
            doc.to_string(),
        );
        sha256.insert("npm-tgz", sha256_hex(&tgz_bytes));

        // cargo: a sparse index (config.json, the crate's index file) and the .crate.
        let src = build.join(format!("crate/{CRATE}-0.1.0"));
        write(
            &src.join("Cargo.toml"),
            format!("[package]\nname = \"{CRATE}\"\nversion = \"0.1.0\"\nedition = \"2021\"\n"),
        );
        write(&src.join("src/lib.rs"), "pub const VALUE: u32 = 1;\n");
        let crate_file = root.join(format!("cargo/dl/{CRATE}/0.1.0/download"));
        std::fs::create_dir_all(crate_file.parent().expect("parent")).expect("dir");
        crate::sh(&format!(
            "tar -C {} -czf {} {CRATE}-0.1.0",
            build.join("crate").display(),
            crate_file.display()
        ));
        let crate_sha = sha256_file(&crate_file);
        write(
            &root.join("cargo/index/config.json"),
            format!(
                "{{\"dl\":\"https://crates.fixture.test:{port}/cargo/dl/{{crate}}/{{version}}/download\"}}\n"
            ),
        );
        write(
            &root.join(format!(
                "cargo/index/{}/{}/{CRATE}",
                &CRATE[..2],
                &CRATE[2..4]
            )),
            format!(
                "{}\n",
                serde_json::json!({"name": CRATE, "vers": "0.1.0", "deps": [], "cksum": crate_sha,
                    "features": {}, "yanked": false})
            ),
        );
        sha256.insert("crate", crate_sha);

        // go: a module proxy (list, info, mod, zip).
        let go_mod = format!("module {GO_MODULE}\n\ngo 1.19\n");
        let at = root.join(format!("go/{GO_MODULE}/@v"));
        write(&at.join("list"), "v0.1.0\n");
        write(
            &at.join("v0.1.0.info"),
            "{\"Version\":\"v0.1.0\",\"Time\":\"2026-01-01T00:00:00Z\"}\n",
        );
        write(&at.join("v0.1.0.mod"), &go_mod);
        let prefix = format!("{GO_MODULE}@v0.1.0");
        zip(
            &at.join("v0.1.0.zip"),
            &[
                (&format!("{prefix}/go.mod"), go_mod.clone()),
                (
                    &format!("{prefix}/egt.go"),
                    "package egt\n\nconst Value = 1\n".to_owned(),
                ),
            ],
        );
        sha256.insert("go-zip", sha256_file(&at.join("v0.1.0.zip")));

        // apt: a .deb and a flat repository index made by dpkg-scanpackages.
        let deb_dir = build.join("deb");
        write(
            &deb_dir.join("DEBIAN/control"),
            format!(
                "Package: {DEB_PACKAGE}\nVersion: 1.0\nArchitecture: all\nMaintainer: egress-tests <tests@fixture.test>\nDescription: egress-agent real-client fixture\n"
            ),
        );
        write(
            &deb_dir.join("usr/share/doc/egress-fixture-deb/README"),
            "fixture\n",
        );
        let apt = root.join("apt");
        std::fs::create_dir_all(&apt).expect("apt dir");
        let deb = apt.join(format!("{DEB_PACKAGE}_1.0_all.deb"));
        crate::sh(&format!(
            "dpkg-deb --root-owner-group -Zgzip --build {} {} >/dev/null && cd {} && dpkg-scanpackages --multiversion . /dev/null > Packages 2>/dev/null",
            deb_dir.display(),
            deb.display(),
            apt.display()
        ));
        sha256.insert("deb", sha256_file(&deb));

        // git: a bare repository with one commit on `main`, served by `git http-backend`.
        let work = build.join("git-work");
        let bare = git.join("fixture.git");
        std::fs::create_dir_all(&git).expect("git dir");
        let file_text = "hello from the fixture repository\n";
        write(&work.join("hello.txt"), file_text);
        crate::sh(&format!(
            "export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null \
             GIT_AUTHOR_NAME=fixture GIT_AUTHOR_EMAIL=f@fixture.test \
             GIT_COMMITTER_NAME=fixture GIT_COMMITTER_EMAIL=f@fixture.test; \
             cd {w} && git init -q -b main && git add hello.txt && git commit -q -m fixture && \
             git clone -q --bare {w} {b} && git -C {b} config http.receivepack true",
            w = work.display(),
            b = bare.display()
        ));
        let git_head = crate::sh(&format!("git -C {} rev-parse main", bare.display()))
            .trim()
            .to_owned();
        sha256.insert("git-file", sha256_hex(file_text.as_bytes()));

        Fixtures {
            root,
            git,
            sha256,
            git_head,
        }
    }

    /// The commit `branch` of the fixture repository points at, if it exists.
    pub fn git_branch(&self, branch: &str) -> Option<String> {
        let o = Command::new("git")
            .arg("-C")
            .arg(self.git.join("fixture.git"))
            .args(["rev-parse", "--verify", "-q"])
            .arg(format!("refs/heads/{branch}"))
            .output()
            .ok()?;
        o.status
            .success()
            .then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    }
}

const SERVER: &str = r#"
import http.server, json, os, socket, ssl, subprocess, sys, urllib.parse
root, gitroot, host, port, cert, key = sys.argv[1:7]
root = os.path.realpath(root)
TYPES = {".html": "text/html", ".json": "application/json", ".gz": "application/gzip"}
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def hit(self, status):
        print("HIT " + json.dumps({"host": self.headers.get("Host", ""), "method": self.command,
              "path": self.path, "status": status, "token": self.headers.get("x-fixture-token")}), flush=True)
    def reply(self, status, body, ctype="application/octet-stream", extra=()):
        self.hit(status)
        self.send_response(status)
        for k, v in extra:
            self.send_header(k, v)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
    def body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                n = int(self.rfile.readline().split(b";")[0], 16)
                if n == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(n)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))
    def do_GET(self):
        u = urllib.parse.urlsplit(self.path)
        if u.path.startswith("/git/"):
            return self.cgi(u)
        rel = urllib.parse.unquote(u.path).lstrip("/")
        fs = os.path.realpath(os.path.join(root, rel))
        if fs != root and not fs.startswith(root + "/"):
            return self.reply(404, b"not found\n", "text/plain")
        if os.path.isdir(fs):
            for idx in ("_index.html", "_index.json"):
                if os.path.isfile(os.path.join(fs, idx)):
                    fs = os.path.join(fs, idx)
                    break
        if not os.path.isfile(fs):
            return self.reply(404, b"not found\n", "text/plain")
        with open(fs, "rb") as f:
            data = f.read()
        self.reply(200, data, TYPES.get(os.path.splitext(fs)[1], "application/octet-stream"))
    do_HEAD = do_GET
    def do_POST(self):
        u = urllib.parse.urlsplit(self.path)
        if u.path.startswith("/git/"):
            return self.cgi(u)
        self.body()
        self.reply(404, b"not found\n", "text/plain")
    def cgi(self, u):
        data = self.body() if self.command == "POST" else b""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_PROJECT_ROOT": gitroot,
               "GIT_HTTP_EXPORT_ALL": "1", "GIT_CONFIG_NOSYSTEM": "1", "HOME": gitroot,
               "REMOTE_USER": "fixture", "REMOTE_ADDR": "127.0.0.1", "GATEWAY_INTERFACE": "CGI/1.1",
               "REQUEST_METHOD": self.command, "PATH_INFO": urllib.parse.unquote(u.path[len("/git"):]),
               "QUERY_STRING": u.query, "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(data))}
        for k, v in self.headers.items():
            env["HTTP_" + k.upper().replace("-", "_")] = v
        out = subprocess.run(["git", "http-backend"], input=data, env=env, capture_output=True).stdout
        sep = b"\r\n\r\n" if b"\r\n\r\n" in out else b"\n\n"
        head, _, rest = out.partition(sep)
        status, ctype, extra = 200, "application/octet-stream", []
        for line in head.decode("latin-1").splitlines():
            k, _, v = line.partition(":")
            k, v = k.strip().lower(), v.strip()
            if k == "status":
                status = int(v.split()[0])
            elif k == "content-type":
                ctype = v
            elif k and k not in ("content-length", "transfer-encoding", "connection"):
                extra.append((k, v))
        self.reply(status, rest, ctype, extra)
class S(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
    daemon_threads = True
    def get_request(self):
        sock, addr = self.socket.accept()
        return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr
    def handle_error(self, request, client_address):
        pass
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
srv = S((host, int(port)), H)
print("READY %d" % srv.server_address[1], flush=True)
srv.serve_forever()
"#;

/// One request as the fixture server saw it.
#[derive(Debug, Clone)]
pub struct Hit {
    /// The Host header (`name:port`).
    pub host: String,
    pub method: String,
    pub path: String,
    pub status: u16,
    /// The `x-fixture-token` header: only the agent adds it (intercepting policy).
    pub token: Option<String>,
}

impl Hit {
    /// The host name without the port.
    pub fn name(&self) -> &str {
        self.host.rsplit_once(':').map_or(&self.host, |(n, _)| n)
    }
}

/// The fixture server (python3, HTTPS with the test CA's certificate for [`NAMES`]): killed on
/// drop.
pub struct RegistryServer {
    server: crate::upstreams::ScriptServer<Hit>,
    pub addr: SocketAddr,
}

impl RegistryServer {
    /// Serve `fx` on `addr` (port 0: any), inside the network namespace `netns` if given (by
    /// name, `ip netns exec`). `ca` holds the server's certificate and key.
    pub fn start(
        fx: &Fixtures,
        ca: &crate::upstreams::TestCa,
        addr: SocketAddr,
        netns: Option<&str>,
    ) -> RegistryServer {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "/usr/bin/python3"]);
                c
            }
            None => Command::new("/usr/bin/python3"),
        };
        cmd.args(["-u", "-c", SERVER])
            .arg(&fx.root)
            .arg(&fx.git)
            .arg(addr.ip().to_string())
            .arg(addr.port().to_string())
            .arg(&ca.cert_pem)
            .arg(&ca.key_pem)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit());
        let (server, port) = crate::upstreams::ScriptServer::start(
            &mut cmd,
            &format!("registry server on {addr}"),
            parse_hit,
        );
        RegistryServer {
            server,
            addr: SocketAddr::new(addr.ip(), port.unwrap_or(0)),
        }
    }

    /// Every request so far.
    pub fn hits(&self) -> Vec<Hit> {
        self.server.hits()
    }
}

/// One `HIT <json>` line of the server.
fn parse_hit(hit: &str) -> Hit {
    let v: serde_json::Value = serde_json::from_str(hit)
        .unwrap_or_else(|e| panic!("registry server printed {hit:?}: {e}"));
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_owned();
    Hit {
        host: s("host"),
        method: s("method"),
        path: s("path"),
        status: v["status"]
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .unwrap_or(0),
        token: v["token"].as_str().map(str::to_owned),
    }
}
