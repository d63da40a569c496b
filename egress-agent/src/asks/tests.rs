//! The registry's rules, without a proxy: identity is the listener, bounds, dedup, decisions
//! reach the waiting request, a run grant goes to the listener that asked and nowhere else.
use super::*;
use std::sync::Mutex as StdMutex;

/// A grant as the target received it: (request, host, port, TTL).
type Granted = (u64, String, u16, Option<Duration>);

#[derive(Default)]
struct Target(StdMutex<Vec<Granted>>);

impl GrantTarget for Target {
    fn grant(&self, id: u64, host: &HostName, port: u16, ttl: Option<Duration>) {
        self.0
            .lock()
            .unwrap()
            .push((id, host.as_str().to_owned(), port, ttl));
    }
}

fn who(listener: u64, target: &Arc<Target>) -> Requester {
    let weak: Weak<dyn GrantTarget> = Arc::downgrade(&(target.clone() as Arc<dyn GrantTarget>));
    Requester {
        listener,
        policy: "ci".into(),
        workload: format!("job-{listener}"),
        run: Some("pr-1".into()),
        target: weak,
        durable: None,
    }
}

fn wanted(host: &str, port: u16) -> Wanted {
    Wanted {
        host: host.into(),
        port,
        reason: "the build downloads its toolchain".into(),
        methods: vec!["get".into()],
        paths: vec![],
    }
}

#[tokio::test]
async fn a_run_approval_reaches_the_waiting_request_and_only_the_listener_that_asked() {
    let asks = Asks::new();
    let (t1, t2) = (Arc::new(Target::default()), Arc::new(Target::default()));
    let now = SystemTime::now();
    let f = asks
        .file(who(1, &t1), wanted("Static.Rust-Lang.org", 443), now)
        .unwrap();
    assert!(!f.existing);
    // The same host:port again is the same request; another listener can't see it.
    let again = asks
        .file(who(1, &t1), wanted("static.rust-lang.org", 443), now)
        .unwrap();
    assert_eq!((again.id, again.existing), (f.id, true));
    assert!(asks.own(f.id, 2).is_none());
    let v = asks.own(f.id, 1).unwrap();
    assert_eq!(
        (v.host.as_str(), v.methods.clone()),
        ("static.rust-lang.org", vec!["GET".to_owned()])
    );
    assert_eq!(v.outcome, Outcome::Pending);

    let waiter = {
        let asks = asks.clone();
        tokio::spawn(async move { asks.wait(f.id, 1, Duration::from_secs(30)).await })
    };
    tokio::task::yield_now().await;
    let ttl = Some(Duration::from_secs(3600));
    asks.approve_run(f.id, "console:ops", ttl).unwrap();
    let decided = waiter.await.unwrap().unwrap();
    assert!(
        matches!(&decided.outcome, Outcome::Approved { scope: Scope::Run, by, until: Some(_) } if by == "console:ops"),
        "{decided:?}"
    );
    assert_eq!(
        t1.0.lock().unwrap().clone(),
        vec![(f.id, "static.rust-lang.org".to_owned(), 443, ttl)]
    );
    assert!(
        t2.0.lock().unwrap().is_empty(),
        "another listener got nothing"
    );
    assert_eq!(
        asks.approve_run(f.id, "x", None).unwrap_err(),
        AskError::Decided(f.id)
    );
    // Asked again after the decision: a new request.
    assert!(
        !asks
            .file(who(1, &t1), wanted("static.rust-lang.org", 443), now)
            .unwrap()
            .existing
    );
}

#[tokio::test]
async fn a_denial_carries_its_reason_and_a_gone_workload_gets_no_grant() {
    let asks = Asks::new();
    let t = Arc::new(Target::default());
    let f = asks
        .file(who(1, &t), wanted("pastebin.test", 443), SystemTime::now())
        .unwrap();
    asks.decide(
        f.id,
        Outcome::Denied {
            by: "token:ops".into(),
            reason: "no paste sites".into(),
        },
    )
    .unwrap();
    let v = asks.wait(f.id, 1, Duration::from_secs(1)).await.unwrap();
    assert_eq!(
        v.outcome,
        Outcome::Denied {
            by: "token:ops".into(),
            reason: "no paste sites".into()
        }
    );
    let g = asks
        .file(who(1, &t), wanted("other.test", 443), SystemTime::now())
        .unwrap();
    drop(t);
    assert_eq!(
        asks.approve_run(g.id, "x", None).unwrap_err(),
        AskError::Gone(g.id)
    );
    assert_eq!(asks.get(g.id).unwrap().outcome, Outcome::Pending);
}

#[test]
fn floods_are_capped_per_listener_and_bad_fields_are_refused_by_name() {
    let asks = Asks::new();
    let t = Arc::new(Target::default());
    let now = SystemTime::now();
    for i in 0..MAX_PENDING {
        asks.file(who(1, &t), wanted(&format!("h{i}.test"), 443), now)
            .unwrap();
    }
    let e = asks
        .file(who(1, &t), wanted("one-more.test", 443), now)
        .unwrap_err();
    assert_eq!(e.status(), 429, "{e}");
    // Another listener is not held back by the first one's flood.
    asks.file(who(2, &t), wanted("h0.test", 443), now).unwrap();
    // Decided ones free their place, but the window still counts them.
    for v in asks
        .list(true)
        .into_iter()
        .filter(|v| v.workload == "job-1")
    {
        asks.decide(
            v.id,
            Outcome::Denied {
                by: "x".into(),
                reason: "no".into(),
            },
        )
        .unwrap();
    }
    let mut filed = MAX_PENDING;
    let e = loop {
        match asks.file(who(1, &t), wanted(&format!("w{filed}.test"), 443), now) {
            Ok(f) => {
                asks.decide(
                    f.id,
                    Outcome::Denied {
                        by: "x".into(),
                        reason: "no".into(),
                    },
                )
                .unwrap();
                filed += 1;
            }
            Err(e) => break e,
        }
    };
    assert_eq!((filed, e.status()), (MAX_PER_WINDOW, 429), "{e}");
    // A new window lets it file again.
    asks.file(
        who(1, &t),
        wanted("later.test", 443),
        now + WINDOW + Duration::from_secs(1),
    )
    .unwrap();
    // Listeners with nothing filed within the window are forgotten (listener 2 asked at `now`).
    assert_eq!(
        asks.lock().filed.keys().copied().collect::<Vec<_>>(),
        vec![1]
    );

    for (w, field) in [
        (
            Wanted {
                host: "10.0.0.1".into(),
                ..wanted("x", 443)
            },
            "host",
        ),
        (
            Wanted {
                host: "a b".into(),
                ..wanted("x", 443)
            },
            "host",
        ),
        (wanted("x.test", 0), "port"),
        (
            Wanted {
                reason: " ".into(),
                ..wanted("x.test", 443)
            },
            "reason",
        ),
        (
            Wanted {
                reason: "x".repeat(MAX_REASON + 1),
                ..wanted("x.test", 443)
            },
            "reason",
        ),
        (
            Wanted {
                reason: "a\u{1b}[31m".into(),
                ..wanted("x.test", 443)
            },
            "reason",
        ),
        (
            Wanted {
                methods: vec!["FETCH".into()],
                ..wanted("x.test", 443)
            },
            "methods",
        ),
        (
            Wanted {
                paths: vec!["no-slash".into()],
                ..wanted("x.test", 443)
            },
            "paths",
        ),
    ] {
        let e = asks.file(who(3, &t), w, now).unwrap_err();
        assert_eq!(e.status(), 400);
        assert!(e.to_string().starts_with(field), "{field}: {e}");
    }
}

#[test]
fn requests_for_auto_approved_hosts_are_approved_for_the_run_at_once_and_no_others() {
    let asks = Asks::new();
    let t = Arc::new(Target::default());
    let cfg: crate::config::RequestsConfig = toml::from_str(
        "auto_approve_hosts = [\"*.pythonhosted.org\", { host = \"mirror.test\", ports = [8080] }]\nauto_approve_presets = [\"python\"]\n",
    )
    .unwrap();
    let asks = asks.configured(cfg.auto_approved());
    let now = SystemTime::now();
    let f = asks
        .file(who(1, &t), wanted("files.pythonhosted.org", 443), now)
        .unwrap();
    assert!(f.auto_approved);
    assert!(matches!(
        asks.get(f.id).unwrap().outcome,
        Outcome::Approved { scope: Scope::Run, ref by, until: None } if by == AUTO
    ));
    // From the preset (pypi.org), and the entry's own port.
    assert!(
        asks.file(who(1, &t), wanted("pypi.org", 443), now)
            .unwrap()
            .auto_approved
    );
    assert!(
        asks.file(who(1, &t), wanted("mirror.test", 8080), now)
            .unwrap()
            .auto_approved
    );
    assert_eq!(
        t.0.lock().unwrap().len(),
        3,
        "each went to the listener that asked"
    );
    // Another port of a plain entry, another port of a ports entry, another host: they wait.
    for (host, port) in [
        ("pypi.org", 80),
        ("mirror.test", 443),
        ("pastebin.test", 443),
    ] {
        let f = asks.file(who(1, &t), wanted(host, port), now).unwrap();
        assert!(!f.auto_approved, "{host}:{port}");
        assert_eq!(asks.get(f.id).unwrap().outcome, Outcome::Pending);
    }
    // A reload without the list: nothing more is approved at once.
    asks.set_auto(Vec::new());
    assert!(
        !asks
            .file(who(2, &t), wanted("pypi.org", 443), now)
            .unwrap()
            .auto_approved
    );
    // An unknown preset is an error naming the known ones.
    let e = toml::from_str::<crate::config::RequestsConfig>("auto_approve_presets = [\"pypy\"]\n")
        .unwrap_err();
    assert!(e.to_string().contains("unknown preset"), "{e}");
}
