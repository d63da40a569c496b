use std::os::unix::fs::PermissionsExt;

use super::*;
use crate::config::kubelet;
use crate::config::policies_dir::DIR_NAME;
use crate::config::policies_dir::tests::names_and_texts;

/// The next change, or `None` if nothing is reported within `wait`.
async fn next(w: &mut PolicyWatch, wait: Duration) -> Option<Vec<String>> {
    tokio::time::timeout(wait, w.changed())
        .await
        .ok()
        .map(|r| r.unwrap())
}

/// Nothing is reported for a while.
async fn assert_quiet(w: &mut PolicyWatch, why: &str) {
    assert!(next(w, NONE_WITHIN).await.is_none(), "{why}");
}

const NONE_WITHIN: Duration = Duration::from_millis(600);
const SOON: Duration = Duration::from_secs(5);

/// A fresh plain `policies.d` (0700): (the test's directory, `policies.d`).
fn plain(tag: &str) -> (PathBuf, PathBuf) {
    let d = kubelet::tempdir(tag);
    let dir = d.join(DIR_NAME);
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    (d, dir)
}

#[test]
fn which_events_count() {
    let f = AddWatchFlags::IN_MOVED_TO;
    assert!(relevant(f, Some("..data")));
    assert!(relevant(AddWatchFlags::IN_CLOSE_WRITE, Some("ci.toml")));
    assert!(relevant(AddWatchFlags::IN_DELETE, Some("ci.toml")));
    assert!(relevant(AddWatchFlags::IN_CREATE, Some("ci.toml")));
    assert!(relevant(AddWatchFlags::IN_Q_OVERFLOW, None));
    assert!(relevant(AddWatchFlags::IN_DELETE_SELF, None));
    for ignored in [
        "..data_tmp",
        "..2026_12_03_07_00_00.1",
        ".ci.toml.tmp-1-2",
        "ci.toml~",
        "4913",
    ] {
        assert!(!relevant(f, Some(ignored)), "{ignored}");
    }
    // The kubelet removing an old version, or a `..data_tmp` appearing, is not a change.
    assert!(!relevant(
        AddWatchFlags::IN_DELETE | AddWatchFlags::IN_ISDIR,
        Some("..2026_12_03_07_00_00.1")
    ));
    assert!(!relevant(AddWatchFlags::IN_MOVED_FROM, Some("..data_tmp")));
    assert!(!relevant(
        AddWatchFlags::IN_CREATE | AddWatchFlags::IN_ISDIR,
        Some("x.toml")
    ));
}

/// The kubelet's update, step by step, is one change; after it the loader reads the new
/// version; the steps that follow the swap (new links, removing the old version) are part of
/// the same burst, not a second change.
#[tokio::test]
async fn a_kubelet_swap_is_one_change() {
    let (d, dir) = kubelet::volume("watch-k8s", &[("web.toml", "mode = \"allow_all\"\n")]);
    let mut w = PolicyWatch::new(&dir).unwrap();
    assert!(w.watching_dir());
    assert_quiet(&mut w, "no change yet").await;

    kubelet::update(
        &dir,
        "2026_12_03_07_05_00.2",
        &[
            ("web.toml", "mode = \"deny_all\"\n"),
            ("ci.toml", "mode = \"allow_all\"\n"),
        ],
    )
    .unwrap();
    let names = next(&mut w, SOON).await.expect("the swap is reported");
    assert!(names.iter().any(|n| n == "..data"), "{names:?}");
    assert!(
        !names
            .iter()
            .any(|n| n == "..data_tmp" || n.starts_with("..2026")),
        "{names:?}"
    );
    assert_eq!(
        names_and_texts(&dir),
        [
            ("ci".to_owned(), "mode = \"allow_all\"\n".to_owned()),
            ("web".to_owned(), "mode = \"deny_all\"\n".to_owned())
        ]
    );
    assert_quiet(&mut w, "one change per swap").await;

    // A key removed: still one change.
    kubelet::update(
        &dir,
        "2026_12_03_07_10_00.3",
        &[("web.toml", "mode = \"deny_all\"\n")],
    )
    .unwrap();
    assert!(next(&mut w, SOON).await.is_some());
    assert_eq!(names_and_texts(&dir).len(), 1);
    assert_quiet(&mut w, "no more changes").await;
    std::fs::remove_dir_all(&d).ok();
}

/// A plain directory: an edit, the API writer's temporary file + rename, a removal are
/// changes; dot-files alone are not.
#[tokio::test]
async fn plain_edits_are_changes_and_dot_files_are_not() {
    let (d, dir) = plain("watch-plain");
    let mut w = PolicyWatch::new(&dir).unwrap();

    std::fs::write(dir.join("ci.toml"), "mode = \"allow_all\"\n").unwrap();
    assert_eq!(next(&mut w, SOON).await.unwrap(), ["ci.toml"]);

    std::fs::write(dir.join(".ci.toml.swp"), "x").unwrap();
    std::fs::remove_file(dir.join(".ci.toml.swp")).unwrap();
    assert_quiet(&mut w, "dot-files only").await;

    // As the control API's writer does: a dot-named temporary file renamed over the policy.
    std::fs::write(dir.join(".ci.toml.tmp-1-0"), "mode = \"deny_all\"\n").unwrap();
    std::fs::rename(dir.join(".ci.toml.tmp-1-0"), dir.join("ci.toml")).unwrap();
    assert_eq!(next(&mut w, SOON).await.unwrap(), ["ci.toml"]);

    std::fs::remove_file(dir.join("ci.toml")).unwrap();
    assert_eq!(next(&mut w, SOON).await.unwrap(), ["ci.toml"]);
    assert_quiet(&mut w, "no more changes").await;
    std::fs::remove_dir_all(&d).ok();
}

/// `policies.d` created after the start (the first managed write) is watched from then on;
/// its removal is a change too.
#[tokio::test]
async fn a_directory_that_appears_later_is_watched() {
    let d = kubelet::tempdir("watch-late");
    let dir = d.join(DIR_NAME);
    let mut w = PolicyWatch::new(&dir).unwrap();
    assert!(!w.watching_dir());
    std::fs::create_dir(&dir).unwrap();
    assert!(
        next(&mut w, SOON).await.is_some(),
        "the directory appearing"
    );
    assert!(w.watching_dir());
    std::fs::write(dir.join("ci.toml"), "mode = \"allow_all\"\n").unwrap();
    assert_eq!(next(&mut w, SOON).await.unwrap(), ["ci.toml"]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(next(&mut w, SOON).await.is_some(), "the directory removed");
    assert!(!w.watching_dir());
    std::fs::remove_dir_all(&d).ok();
}

/// `run` reports each change and ends when stopped.
#[tokio::test]
async fn run_ends_on_stop() {
    let (d, dir) = plain("watch-run");
    let w = PolicyWatch::new(&dir).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(run(w, stop.clone(), move |names| {
        tx.send(names).ok();
        async {}
    }));
    std::fs::write(dir.join("a.toml"), "mode = \"allow_all\"\n").unwrap();
    std::fs::write(dir.join("b.toml"), "mode = \"allow_all\"\n").unwrap();
    let names = tokio::time::timeout(SOON, rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(names, ["a.toml", "b.toml"], "one burst, one change");
    stop.cancel();
    tokio::time::timeout(SOON, task).await.unwrap().unwrap();
    std::fs::remove_dir_all(&d).ok();
}
