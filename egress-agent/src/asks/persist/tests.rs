//! The saved registry: what a restart restores, to whom, and what it refuses to read.
use super::*;
use crate::asks::{Asks, Filed};
use egress_policy::name::HostName;
use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};

type Granted = (u64, String, u16, Option<Duration>);

#[derive(Default)]
struct Target(Mutex<Vec<Granted>>);

impl GrantTarget for Target {
    fn grant(&self, id: u64, host: &HostName, port: u16, ttl: Option<Duration>) {
        self.0
            .lock()
            .unwrap()
            .push((id, host.as_str().to_owned(), port, ttl));
    }
}

impl Target {
    fn got(&self) -> Vec<Granted> {
        self.0.lock().unwrap().clone()
    }
}

const BOOT: &str = "3f1c0e6a-boot";

fn key(cgroup_id: u64) -> Durable {
    Durable {
        container: "c0ffee".into(),
        cgroup_id,
        policy: "ci".into(),
        ipv6: false,
    }
}

fn weak(t: &Arc<Target>) -> Weak<dyn GrantTarget> {
    Arc::downgrade(&(t.clone() as Arc<dyn GrantTarget>))
}

fn who(listener: u64, t: &Arc<Target>, durable: Option<Durable>) -> Requester {
    Requester {
        listener,
        policy: "ci".into(),
        workload: "job".into(),
        run: Some("pr-7".into()),
        target: weak(t),
        durable,
    }
}

fn wanted(host: &str) -> Wanted {
    Wanted {
        host: host.into(),
        port: 443,
        reason: "the build needs it".into(),
        methods: vec!["GET".into()],
        paths: vec!["/v1".into()],
    }
}

/// A registry kept in `dir` for boot `boot`, started at `now`.
fn kept(dir: &Path, boot: &str, now: SystemTime) -> (Arc<Asks>, usize) {
    let a = Asks::new();
    let n = a.keep_in_boot(dir, boot.to_owned(), now);
    (a, n)
}

/// Files three requests of workload `key(7)` on listener 5 (one approved for its run with a TTL,
/// one for its lifetime, one pending) and one of a workload without a durable identity.
fn three_and_one(dir: &Path) -> (Filed, Filed, Filed) {
    let (a, n) = kept(dir, BOOT, SystemTime::now());
    assert_eq!(n, 0);
    let t = Arc::new(Target::default());
    let now = SystemTime::now();
    let ttl = a
        .file(who(5, &t, Some(key(7))), wanted("ttl.example"), now)
        .unwrap();
    let life = a
        .file(who(5, &t, Some(key(7))), wanted("life.example"), now)
        .unwrap();
    let pending = a
        .file(who(5, &t, Some(key(7))), wanted("later.example"), now)
        .unwrap();
    a.file(who(6, &t, None), wanted("exec.example"), now)
        .unwrap();
    a.approve_run(ttl.id, "token:ops", Some(Duration::from_secs(3600)))
        .unwrap();
    a.approve_run(life.id, "token:ops", None).unwrap();
    (ttl, life, pending)
}

#[tokio::test]
async fn a_restart_gives_requests_and_grants_back_to_the_same_workload_only() {
    let dir = crate::test_dir::fresh("asks-round-trip");
    let (ttl, life, pending) = three_and_one(&dir);
    let file = dir.join(FILE_NAME);
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let (b, n) = kept(&dir, BOOT, SystemTime::now());
    assert_eq!(n, 3, "the request without a durable identity is not kept");
    // Nobody owns them until the workload's listener is bound again.
    assert!(b.own(pending.id, 5).is_none());
    assert_eq!(b.list(true).len(), 1);

    // Another cgroup (a restarted container), another policy, the other family: nothing.
    let stranger = Arc::new(Target::default());
    let mut other_policy = key(7);
    other_policy.policy = "wide".into();
    let mut v6 = key(7);
    v6.ipv6 = true;
    for k in [key(8), other_policy, v6] {
        assert_eq!(b.adopt(&k, 40, &weak(&stranger)), 0);
    }
    assert!(stranger.got().is_empty());
    assert!(b.own(pending.id, 40).is_none());

    let back = Arc::new(Target::default());
    assert_eq!(b.adopt(&key(7), 41, &weak(&back)), 3);
    let got = back.got();
    assert_eq!(got.len(), 2, "{got:?}");
    let (id, host, port, left) = got.iter().find(|g| g.0 == ttl.id).cloned().unwrap();
    assert_eq!((id, host.as_str(), port), (ttl.id, "ttl.example", 443));
    let left = left.unwrap();
    assert!(
        left > Duration::from_secs(3500) && left <= Duration::from_secs(3600),
        "the same end: {left:?}"
    );
    assert!(got.contains(&(life.id, "life.example".into(), 443, None)));
    // The pending request answers under its id, to its workload's new listener; the operator
    // can still decide it, and the grant goes there.
    let v = b.own(pending.id, 41).unwrap();
    assert_eq!(
        (v.host.as_str(), v.outcome),
        ("later.example", Outcome::Pending)
    );
    assert_eq!(v.paths, vec!["/v1".to_owned()]);
    b.approve_run(pending.id, "token:ops", None).unwrap();
    assert!(back.got().iter().any(|g| g.0 == pending.id));
    // Taken once: a second listener for the same identity gets nothing more.
    assert_eq!(b.adopt(&key(7), 42, &weak(&stranger)), 0);
    assert!(stranger.got().is_empty());
}

#[tokio::test]
async fn new_ids_continue_after_the_highest_restored_one() {
    let dir = crate::test_dir::fresh("asks-ids");
    let (_, _, pending) = three_and_one(&dir);
    let (b, _) = kept(&dir, BOOT, SystemTime::now());
    let t = Arc::new(Target::default());
    let f = b
        .file(
            who(9, &t, Some(key(11))),
            wanted("new.example"),
            SystemTime::now(),
        )
        .unwrap();
    // The request without a durable identity had the highest id: still never given again.
    assert_eq!(f.id, pending.id + 2);
    // And the next start continues after that one.
    let (c, _) = kept(&dir, BOOT, SystemTime::now());
    let g = c
        .file(
            who(9, &t, Some(key(11))),
            wanted("next.example"),
            SystemTime::now(),
        )
        .unwrap();
    assert_eq!(g.id, f.id + 1);
}

#[tokio::test]
async fn another_boots_file_and_ended_ttls_give_nothing() {
    let dir = crate::test_dir::fresh("asks-boot");
    let (ttl, life, _) = three_and_one(&dir);
    let (b, n) = kept(&dir, "another-boot", SystemTime::now());
    assert_eq!(n, 0);
    assert!(b.list(false).is_empty());

    // Two hours later the TTL grant has ended: the request stays approved, its grant is not
    // laid again; the lifetime one is.
    let later = SystemTime::now() + Duration::from_secs(7200);
    let (c, n) = kept(&dir, BOOT, later);
    assert_eq!(n, 3);
    let t = Arc::new(Target::default());
    c.adopt(&key(7), 3, &weak(&t));
    assert_eq!(
        t.got().iter().map(|g| g.0).collect::<Vec<_>>(),
        vec![life.id]
    );
    assert!(matches!(
        c.own(ttl.id, 3).unwrap().outcome,
        Outcome::Approved {
            scope: Scope::Run,
            ..
        }
    ));
}

#[tokio::test]
async fn a_workload_that_ended_or_never_came_back_is_not_kept() {
    let dir = crate::test_dir::fresh("asks-forget");
    three_and_one(&dir);
    let (b, _) = kept(&dir, BOOT, SystemTime::now());
    let t = Arc::new(Target::default());
    b.file(
        who(9, &t, Some(key(12))),
        wanted("other.example"),
        SystemTime::now(),
    )
    .unwrap();
    // key(7) never came back: once every runtime reconciled, it is dropped from the file.
    assert_eq!(b.forget_unclaimed(), 3);
    // key(12) ended.
    b.forget("c0ffee", 12);
    let (c, n) = kept(&dir, BOOT, SystemTime::now());
    assert_eq!(n, 0);
    assert_eq!(c.adopt(&key(7), 1, &weak(&t)), 0);
}

fn refused(dir: &Path) -> bool {
    let (a, n) = kept(dir, BOOT, SystemTime::now());
    n == 0 && a.list(false).is_empty()
}

#[tokio::test]
async fn a_file_that_cant_be_trusted_is_ignored_and_replaced() {
    let dir = crate::test_dir::fresh("asks-corrupt");
    three_and_one(&dir);
    let file = dir.join(FILE_NAME);
    let good = std::fs::read_to_string(&file).unwrap();

    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(refused(&dir), "a mode open to others");
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(!refused(&dir), "the same file, private");

    let write = |text: &str| {
        std::fs::write(&file, text).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    };
    write("{\"version\": 1, \"boot_id\": ");
    assert!(refused(&dir), "truncated JSON");
    write(&good.replacen("\"version\":1", "\"version\":2", 1));
    assert!(refused(&dir), "another version");
    write(&good.replacen("\"host\":\"ttl.example\"", "\"host\":\"10.0.0.1\"", 1));
    assert!(refused(&dir), "an address where a name belongs");
    write(&good.replacen("\"boot_id\"", "\"extra\":1,\"boot_id\"", 1));
    assert!(refused(&dir), "an unknown field");

    if nix::unistd::geteuid().is_root() {
        write(&good);
        std::os::unix::fs::chown(&file, Some(65534), Some(65534)).unwrap();
        assert!(refused(&dir), "another owner");
    } else {
        eprintln!("skipping the owner check: not root");
    }

    std::fs::remove_file(&file).unwrap();
    std::os::unix::fs::symlink(dir.join("elsewhere"), &file).unwrap();
    assert!(refused(&dir), "a link");
    std::fs::remove_file(&file).unwrap();

    // Ignored, then replaced at the next change by a file of this agent's own.
    write("not json");
    let (a, _) = kept(&dir, BOOT, SystemTime::now());
    let t = Arc::new(Target::default());
    a.file(
        who(1, &t, Some(key(3))),
        wanted("fresh.example"),
        SystemTime::now(),
    )
    .unwrap();
    let (_, n) = kept(&dir, BOOT, SystemTime::now());
    assert_eq!(n, 1);
}
