//! Unprivileged tests of the write path: plan (validation through the loader), commit,
//! rollback, apply with a fake reload, import/export.
use super::*;
use std::os::unix::fs::PermissionsExt;
use std::sync::Mutex;

struct Recorder(Mutex<Vec<(u32, String, String)>>);

impl ChangeLog for Recorder {
    fn record(&self, who: &Who, change: &Change, _files: &[PathBuf], _diff: &str, result: &str) {
        self.0
            .lock()
            .unwrap()
            .push((who.uid, change.action().to_owned(), result.to_owned()));
    }
}

fn setup(main: &str) -> PathBuf {
    let p = crate::test_dir::fresh("manage-t").join("config.toml");
    std::fs::write(&p, main).unwrap();
    p
}

const MAIN: &str = "# operator's file\n[agent]\ndefault_policy = \"deny_all\"\n\n[policies.handmade]\nallow_hosts = [\"example.com\"]\n";

fn toml_body(s: &str) -> Body {
    Body::Toml(s.to_owned())
}

fn who() -> Who {
    Who {
        uid: 0,
        pid: Some(1),
        identity: None,
    }
}

fn none() -> BTreeMap<String, Vec<String>> {
    BTreeMap::new()
}

#[test]
fn a_policy_is_written_to_policies_d_and_loaded_by_config_load() {
    let cfg = setup(MAIN);
    let parts = Parts::read(&cfg).unwrap();
    let plan = plan(
        &parts,
        &Change::SetPolicy {
            name: "ci".into(),
            body: toml_body("# comment kept\nallow_hosts = [\"github.com\"]\n"),
        },
        &none(),
    )
    .unwrap();
    assert_eq!(plan.ops.len(), 1);
    commit(&plan.ops).unwrap();
    let file = cfg.parent().unwrap().join("policies.d/ci.toml");
    assert!(
        std::fs::read_to_string(&file)
            .unwrap()
            .starts_with("# comment kept")
    );
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let c = Config::load(&cfg).unwrap();
    assert_eq!(
        c.policy("ci").unwrap().allow_hosts[0].to_string(),
        "github.com"
    );
    assert!(c.policy("handmade").is_some());
    // Rollback restores the directory as it was.
    rollback(&plan.ops);
    assert!(!file.exists());
    assert!(Config::load(&cfg).unwrap().policy("ci").is_none());
}

#[test]
fn validation_errors_are_the_config_files_own() {
    let cfg = setup(MAIN);
    let parts = Parts::read(&cfg).unwrap();
    let bad = "allow_hosts = [\n  \"github.com\",\n  \"10.0.0.1\",\n]\n";
    let e = plan(
        &parts,
        &Change::SetPolicy {
            name: "ci".into(),
            body: toml_body(bad),
        },
        &none(),
    )
    .unwrap_err();
    assert_eq!(e.status(), 422);
    let body = e.body();
    assert_eq!(body["field"], "policies.ci.allow_hosts[1]", "{body}");
    assert_eq!(
        (body["line"].as_u64(), body["column"].as_u64()),
        (Some(3), Some(3)),
        "{body}"
    );
    // Exactly what the same policy in the main file says (field and reason).
    let same_in_main =
        Config::from_toml_str(&format!("[policies.ci]\n{bad}"), Path::new("x.toml")).unwrap_err();
    let ConfigError::Invalid { field, message, .. } = same_in_main else {
        panic!("not located")
    };
    assert_eq!(body["field"], field.as_str());
    assert_eq!(body["message"], message.as_str());
    // The same file loaded from policies.d by Config::load names that file.
    let dir = cfg.parent().unwrap().join("policies.d");
    dir::write_atomic(&dir.join("ci.toml"), bad.as_bytes()).unwrap();
    let e = Config::load(&cfg).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}:3:3: policies.ci.allow_hosts[1]: ",
            dir.join("ci.toml").display()
        )),
        "{e}"
    );
}

#[test]
fn json_bodies_are_validated_by_the_same_loader() {
    let cfg = setup(MAIN);
    let parts = Parts::read(&cfg).unwrap();
    let e = plan(
        &parts,
        &Change::SetPolicy {
            name: "ci".into(),
            body: Body::Json(r#"{"allow_hosts": ["github.com"], "allow_port": [443]}"#.into()),
        },
        &none(),
    )
    .unwrap_err();
    assert_eq!(e.body()["field"], "policies.ci.allow_port", "{}", e.body());
    assert!(e.to_string().contains("unknown field"), "{e}");
    let e = plan(
        &parts,
        &Change::SetPolicy {
            name: "ci".into(),
            body: Body::Json(
                r#"{"deny_cidrs": ["10.0.0.0/8"], "allow_cidrs": ["10.1.0.0/16"]}"#.into(),
            ),
        },
        &none(),
    )
    .unwrap_err();
    assert_eq!(
        e.body()["field"],
        "policies.ci.deny_cidrs[0]",
        "{}",
        e.body()
    );
    let ok = plan(
        &parts,
        &Change::SetPolicy {
            name: "ci".into(),
            body: Body::Json(
                r#"{"allow_hosts": ["github.com", {"host": "ssh.github.com", "ports": [22]}]}"#
                    .into(),
            ),
        },
        &none(),
    )
    .unwrap();
    assert_eq!(
        ok.config.policy("ci").unwrap().allow_hosts[1].ports,
        vec![22]
    );
}

#[test]
fn names_builtins_main_file_policies_and_conflicts() {
    let cfg = setup(MAIN);
    let parts = Parts::read(&cfg).unwrap();
    let set = |name: &str| Change::SetPolicy {
        name: name.into(),
        body: toml_body("mode = \"deny_all\"\n"),
    };
    for bad in ["../../etc/passwd", "a.b", "", "x y"] {
        let e = plan(&parts, &set(bad), &none()).unwrap_err();
        assert_eq!(e.status(), 422, "{bad}");
        assert!(e.to_string().contains("policy names are"), "{e}");
    }
    let e = plan(&parts, &set("allow_all"), &none()).unwrap_err();
    assert!(e.to_string().contains("built-in"), "{e}");
    let e = plan(&parts, &set("handmade"), &none()).unwrap_err();
    assert_eq!(e.status(), 409, "{e}");
    let e = plan(
        &parts,
        &Change::DeletePolicy {
            name: "handmade".into(),
            force: true,
        },
        &none(),
    )
    .unwrap_err();
    assert_eq!(e.status(), 409, "{e}");
    let e = plan(
        &parts,
        &Change::DeletePolicy {
            name: "nope".into(),
            force: false,
        },
        &none(),
    )
    .unwrap_err();
    assert_eq!(e.status(), 404, "{e}");
    // A policy in both places (by hand) is a located error of the main file.
    let dir = cfg.parent().unwrap().join("policies.d");
    dir::write_atomic(&dir.join("handmade.toml"), b"mode = \"deny_all\"\n").unwrap();
    let e = Config::load(&cfg).unwrap_err().to_string();
    assert!(
        e.contains(":5:") && e.contains("policies.handmade: also defined in"),
        "{e}"
    );
}

#[test]
fn delete_refuses_a_policy_in_use_unless_forced_and_the_defaults() {
    let cfg = setup(MAIN);
    let dir = cfg.parent().unwrap().join("policies.d");
    dir::write_atomic(&dir.join("ci.toml"), b"allow_hosts = [\"github.com\"]\n").unwrap();
    let parts = Parts::read(&cfg).unwrap();
    let in_use = BTreeMap::from([("ci".to_owned(), vec!["build-1".to_owned()])]);
    let del = |force| Change::DeletePolicy {
        name: "ci".into(),
        force,
    };
    let e = plan(&parts, &del(false), &in_use).unwrap_err();
    assert!(
        e.status() == 409 && e.to_string().contains("build-1"),
        "{e}"
    );
    assert_eq!(plan(&parts, &del(true), &in_use).unwrap().ops.len(), 1);
    // The default policy can't be deleted: the loader says why, located in the main file.
    let d = plan(
        &parts,
        &Change::SetDefaults {
            default_policy: Some("ci".into()),
            unlabeled: None,
        },
        &none(),
    )
    .unwrap();
    commit(&d.ops).unwrap();
    let e = plan(&Parts::read(&cfg).unwrap(), &del(true), &none()).unwrap_err();
    assert_eq!(e.body()["field"], "agent.default_policy", "{}", e.body());
    assert!(
        std::fs::read_to_string(&cfg)
            .unwrap()
            .starts_with("# operator's file\n")
    );
}

#[tokio::test]
async fn a_refused_reload_restores_the_files_and_is_recorded() {
    let cfg = setup(MAIN);
    let log = Recorder(Mutex::new(Vec::new()));
    let change = Change::SetPolicy {
        name: "ci".into(),
        body: toml_body("allow_hosts = [\"github.com\"]\n"),
    };
    let cfg2 = cfg.clone();
    let e = apply(&cfg, &change, &who(), &none(), &log, || async move {
        // The reload sees the new file on disk…
        assert!(Config::load(&cfg2).unwrap().policy("ci").is_some());
        Err("[proxy] changed: these settings take effect only on a restart".to_owned())
    })
    .await
    .unwrap_err();
    assert_eq!(e.status(), 422);
    assert!(e.to_string().contains("running policy stays"), "{e}");
    // …and after the refusal it is gone again.
    assert!(Config::load(&cfg).unwrap().policy("ci").is_none());
    let ok = apply(&cfg, &change, &who(), &none(), &log, || async {
        Ok(serde_json::json!({}))
    })
    .await
    .unwrap();
    assert_eq!(ok["changed"], true);
    assert!(Config::load(&cfg).unwrap().policy("ci").is_some());
    // The same again changes nothing and reloads nothing.
    let again = apply(&cfg, &change, &who(), &none(), &log, || async {
        panic!("no reload for a no-op")
    })
    .await
    .unwrap();
    assert_eq!(again["changed"], false);
    let rec = log.0.lock().unwrap().clone();
    assert_eq!(rec.len(), 2);
    assert!(rec[0].2.starts_with("refused:"));
    assert_eq!(rec[1].2, "applied");
}

#[test]
fn export_import_round_trip_with_diff_and_prune() {
    let cfg = setup(MAIN);
    let dir = cfg.parent().unwrap().join("policies.d");
    dir::write_atomic(&dir.join("ci.toml"), b"allow_hosts = [\"github.com\"]\n").unwrap();
    dir::write_atomic(&dir.join("old.toml"), b"mode = \"deny_all\"\n").unwrap();
    let exported = bundle::Bundle::export(&Config::load(&cfg).unwrap());
    let text = exported.to_toml();
    // An export is a valid config fragment.
    Config::from_toml_str(&text, Path::new("export.toml")).unwrap();

    // Import onto another host: everything is new.
    let other = setup("[agent]\ndefault_policy = \"audit\"\n");
    let dry = dry_run(
        &other,
        &Change::Import {
            bundle: Body::Toml(text.clone()),
            prune: false,
        },
        &none(),
    )
    .unwrap();
    let diff = dry["diff"].as_str().unwrap();
    assert!(
        diff.contains("+ policy ci") && diff.contains("+ policy handmade"),
        "{diff}"
    );
    assert!(diff.contains("~ agent.default_policy"), "{diff}");
    assert!(
        !other.parent().unwrap().join("policies.d").exists(),
        "dry run wrote nothing"
    );
    let p = plan(
        &Parts::read(&other).unwrap(),
        &Change::Import {
            bundle: Body::Toml(text.clone()),
            prune: false,
        },
        &none(),
    )
    .unwrap();
    commit(&p.ops).unwrap();
    let a = Config::load(&cfg).unwrap();
    let b = Config::load(&other).unwrap();
    assert_eq!(a.policies, b.policies);
    assert_eq!(a.agent.default_policy, b.agent.default_policy);

    // Back on the first host: a changed policy and prune.
    let mut changed = exported.clone();
    changed.policies.remove("old");
    changed.policies.get_mut("ci").unwrap().allow_ports = vec![443, 8443];
    let json = serde_json::to_string(&changed).unwrap();
    let d = dry_run(
        &cfg,
        &Change::Import {
            bundle: Body::Json(json.clone()),
            prune: true,
        },
        &none(),
    )
    .unwrap();
    let diff = d["diff"].as_str().unwrap();
    assert!(
        diff.contains("~ policy ci") && diff.contains("+   ") && diff.contains("8443"),
        "{diff}"
    );
    assert!(diff.contains("- policy old"), "{diff}");
    assert!(diff.contains("= policy handmade"), "{diff}");
    // A bundle that changes a main-file policy is a conflict.
    let mut hand = exported.clone();
    hand.policies.get_mut("handmade").unwrap().allow_ports = vec![1];
    let e = dry_run(
        &cfg,
        &Change::Import {
            bundle: Body::Json(serde_json::to_string(&hand).unwrap()),
            prune: false,
        },
        &none(),
    )
    .unwrap_err();
    assert_eq!(e.status(), 409, "{e}");
    // Bundle errors are located like a config file's.
    let e = dry_run(
        &cfg,
        &Change::Import {
            bundle: Body::Toml("[policies.x]\nallow_hosts = [\"*bad\"]\n".into()),
            prune: false,
        },
        &none(),
    )
    .unwrap_err();
    assert_eq!(e.status(), 422);
    assert!(
        e.body()["field"]
            .as_str()
            .unwrap()
            .starts_with("policies.x.allow_hosts"),
        "{}",
        e.body()
    );
}

/// What import writes (the canonical TOML of a policy) loads back to the same policy, for every
/// policy of the shipped example.
#[test]
fn canonical_policy_text_round_trips() {
    let example = include_str!("../../../config/example.toml");
    let c = Config::from_toml_str(example, Path::new("example.toml")).unwrap();
    assert!(c.policies.len() >= 4);
    for (name, p) in &c.policies {
        let again = Config::load_parts(
            Path::new("/etc/egress-agent/config.toml"),
            "",
            vec![PolicyFile {
                name: name.clone(),
                path: PathBuf::from(format!("/etc/egress-agent/policies.d/{name}.toml")),
                text: bundle::canonical(p),
            }],
        )
        .unwrap();
        assert_eq!(again.policy(name), Some(p), "{name}");
    }
}
