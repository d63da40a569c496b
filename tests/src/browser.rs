//! A headless Chromium driven over its DevTools protocol (by node: `tests/status_page/cdp.js`)
//! in a test's network namespace, for the status page tests.
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The browser tests need Debian's chromium (`cargo xtask setup` installs it): fail loudly
/// without it rather than skip.
pub fn require_chromium() {
    if Command::new("chromium").arg("--version").output().is_err() {
        panic!("chromium is not installed (cargo xtask setup installs it)");
    }
}

pub struct Browser {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    _profile: PathBuf,
}

impl Browser {
    /// node + headless Chromium in the daemon's network namespace, on `url`.
    pub fn open(netns: &Path, url: &str, profile: PathBuf) -> Browser {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("status_page/cdp.js");
        std::fs::remove_dir_all(&profile).ok();
        let mut child = Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .args(["node", "--experimental-websocket", "--no-warnings"])
            .arg(&script)
            .args(["/usr/bin/chromium", url])
            .arg(&profile)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("node (nodejs) runs the DevTools driver");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Browser {
            child,
            stdin,
            stdout,
            _profile: profile,
        }
    }

    pub fn ask(&mut self, cmd: &str) -> Value {
        writeln!(self.stdin, "{cmd}").expect("to the driver");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("from the driver");
        let v: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("driver said {line:?}: {e}"));
        assert!(v.get("error").is_none(), "driver: {v}");
        v
    }

    /// The value of a JavaScript expression evaluated in the page (a promise is awaited).
    pub fn eval(&mut self, js: &str) -> Value {
        let arg = serde_json::to_string(js).expect("a JSON string");
        self.ask(&format!("eval {arg}"))["value"].clone()
    }

    /// Poll `js` until it is true.
    pub fn wait_true(&mut self, what: &str, js: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.eval(js) != Value::Bool(true) {
            assert!(
                Instant::now() < deadline,
                "the page never showed {what}:\n{}",
                self.dom()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn dom(&mut self) -> String {
        self.ask("dom")["html"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Poll the rendered DOM until `f` holds.
    pub fn wait_dom(&mut self, what: &str, f: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let dom = self.dom();
            if f(&dom) {
                return dom;
            }
            assert!(
                Instant::now() < deadline,
                "the page never showed {what}:\n{dom}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        writeln!(self.stdin, "quit").ok();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// The `<tr data-KIND="NAME">` row of the rendered page.
pub fn row<'a>(dom: &'a str, kind: &str, name: &str) -> Option<&'a str> {
    let start = dom.find(&format!("<tr data-{kind}=\"{name}\""))?;
    let end = dom[start..].find("</tr>")? + start;
    Some(&dom[start..end])
}

/// The `<tr>` of container `name` in the rendered containers table.
pub fn container_row<'a>(dom: &'a str, name: &str) -> Option<&'a str> {
    row(dom, "container", name)
}
