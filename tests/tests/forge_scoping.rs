//! Forge scoping with a real git client (#36 item 3): a read-only forge host with `repos` takes
//! a `git push` to the named repository and refuses one to another repository of the same
//! forge — proven by what arrived at the fixture (its bare repositories and its request log) —
//! while fetching from either still works. Under `egress-agent exec`, through the explicit
//! proxy and transparently (no proxy variables). Run as root (CI is root); unprivileged, it
//! says it skipped.
use std::path::Path;
use std::process::{Command, Stdio};

use egress_tests::agent::{TestConfig, assert_enforcement_intact, exec_cmd};
use egress_tests::registries::{Fixtures, NAMES, RegistryServer};
use egress_tests::upstreams::{TempDir, TestCa};
use egress_tests::{marker, root_or_skip};

const FORGE: &str = "gitpush.fixture.test";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port()
}

fn git(args: &[&str], at: &Path) -> std::process::Output {
    Command::new("git")
        .args(args)
        .current_dir(at)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .output()
        .expect("git")
}

/// Does the bare repository `repo` have the branch `branch`?
fn has_branch(repo: &Path, branch: &str) -> bool {
    git(
        &[
            "rev-parse",
            "--verify",
            "-q",
            &format!("refs/heads/{branch}"),
        ],
        repo,
    )
    .status
    .success()
}

/// The script a confined command runs: clone the named repository, push a commit to it, fetch
/// the other repository, then try to push the same commit there; prints each step's status.
fn script(port: u16, run: &str) -> String {
    format!(
        r#"set -u
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_TERMINAL_PROMPT=0
export GIT_AUTHOR_NAME=agent GIT_AUTHOR_EMAIL=agent@fixture.test GIT_COMMITTER_NAME=agent GIT_COMMITTER_EMAIL=agent@fixture.test
cd "$W"
git clone -q "https://{FORGE}:{port}/git/fixture.git" clone; echo "clone-rc=$?"
cd clone
echo {run} > pushed.txt && git add pushed.txt && git commit -q -m {run}
git push -q origin "HEAD:refs/heads/{run}-ok"; echo "push-ok-rc=$?"
git remote add other "https://{FORGE}:{port}/git/other.git"
git fetch -q other; echo "fetch-other-rc=$?"
git push -q other "HEAD:refs/heads/{run}-bad" 2>&1; echo "push-bad-rc=$?"
"#
    )
}

#[test]
fn a_push_reaches_only_the_repositories_the_policy_names() {
    if !root_or_skip("forge scoping") {
        return;
    }
    let port = free_port();
    let dir = TempDir::new("forge");
    let base = dir.path();
    std::fs::create_dir_all(base.join("cfg")).expect("cfg dir");
    let ca = TestCa::new(&base.join("cfg"), NAMES);
    let fx = Fixtures::build(&base.join("fixture"), port);
    // A second repository on the same forge, which the policy does not name.
    let other = fx.git.join("other.git");
    assert!(
        git(
            &[
                "clone",
                "-q",
                "--bare",
                &fx.git.join("fixture.git").display().to_string(),
                &other.display().to_string()
            ],
            base
        )
        .status
        .success()
    );
    assert!(
        git(&["config", "http.receivepack", "true"], &other)
            .status
            .success()
    );
    let server = RegistryServer::start(
        &fx,
        &ca,
        format!("127.0.0.1:{port}").parse().expect("addr"),
        None,
    );
    let agent = base.join("agent");
    std::fs::create_dir_all(agent.join("state")).expect("state");
    std::fs::write(agent.join("hosts"), format!("127.0.0.1 {FORGE}\n")).expect("hosts");
    let a = agent.display();
    let mut policies = String::new();
    for transparent in [true, false] {
        policies.push_str(&format!(
            "[policies.forge_{transparent}]\nallow_hosts = [{{ host = \"{FORGE}\", access = \"read-only\" }}]\nallow_ports = [{port}]\nresolve_private = [\"127.0.0.0/8\"]\nrepos = [\"git/fixture\"]\ntransparent = {transparent}\n\n"
        ));
    }
    let cfg = TestConfig::new(&format!(
        "connect_timeout_ms = 5000\n[agent]\nstate_dir = \"{a}/state\"\n[intercept]\nupstream_ca_file = \"{}\"\n[dns]\nnameservers = []\nhosts_file = \"{a}/hosts\"\n\n{policies}",
        ca.ca_pem.display()
    ));
    for transparent in [true, false] {
        let run = marker(if transparent {
            "transparent"
        } else {
            "explicit"
        });
        let work = base.join(&run);
        std::fs::create_dir_all(&work).expect("work dir");
        let mut cmd = exec_cmd(&format!("forge_{transparent}"), Some(&cfg.path));
        cmd.args(["sh", "-c", &script(port, &run)])
            .env("W", &work)
            .env("HOME", &work);
        for v in egress_agent::ca::trust::CA_VARIABLES {
            cmd.env_remove(v.name);
        }
        if transparent {
            for v in [
                "HTTP_PROXY",
                "HTTPS_PROXY",
                "http_proxy",
                "https_proxy",
                "ALL_PROXY",
                "all_proxy",
            ] {
                cmd.env_remove(v);
            }
        }
        let before = server.hits().len();
        let o = cmd
            .stdin(Stdio::null())
            .output()
            .expect("egress-agent exec");
        let out = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        for step in ["clone-rc=0", "push-ok-rc=0", "fetch-other-rc=0"] {
            assert!(out.contains(step), "{run}: no {step}:\n{out}");
        }
        assert!(
            !out.contains("push-bad-rc=0"),
            "{run}: the push to another repository went through:\n{out}"
        );
        assert!(out.contains("403"), "{run}: git did not say 403:\n{out}");
        // What arrived: the named repository has the branch; the other one has nothing, and
        // the fixture never got its receive-pack request.
        assert!(
            has_branch(&fx.git.join("fixture.git"), &format!("{run}-ok")),
            "{run}: the allowed push did not arrive:\n{out}"
        );
        assert!(
            !has_branch(&other, &format!("{run}-bad")),
            "{run}: the refused push arrived"
        );
        let hits = server.hits();
        let hits = &hits[before..];
        assert!(
            hits.iter()
                .any(|h| h.method == "POST" && h.path == "/git/fixture.git/git-receive-pack"),
            "{run}: {hits:?}"
        );
        assert!(
            hits.iter()
                .any(|h| h.method == "POST" && h.path == "/git/other.git/git-upload-pack"),
            "{run}: the fetch from the other repository did not arrive: {hits:?}"
        );
        assert!(
            !hits
                .iter()
                .any(|h| h.method == "POST" && h.path.ends_with("other.git/git-receive-pack")),
            "{run}: the refused push reached the forge: {hits:?}"
        );
    }
    assert_enforcement_intact("after forge scoping");
}
