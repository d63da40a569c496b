use std::os::unix::fs::{PermissionsExt, symlink};

use super::*;
use crate::config::kubelet;

/// The policies of `dir` as (name, text).
pub(crate) fn names_and_texts(dir: &Path) -> Vec<(String, String)> {
    read_policies(dir)
        .unwrap()
        .into_iter()
        .map(|f| (f.name, f.text))
        .collect()
}

/// A ConfigMap volume: every policy read once, through `..data`, named by its key; the
/// kubelet's dot-entries (`..data`, `..<timestamp>`, a leftover `..data_tmp`) are not read.
#[test]
fn a_kubelet_layout_is_read_once_through_data() {
    let (d, dir) = kubelet::volume(
        "k8s-read",
        &[("web.toml", "mode = \"allow_all\"\n"), ("README", "notes")],
    );
    assert!(kubernetes_managed(&dir));
    // A leftover of an interrupted update: another version and `..data_tmp` pointing at it.
    let stale = dir.join("..2026_12_03_06_00_00.000000001");
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("web.toml"), "mode = \"deny_all\"\n").unwrap();
    std::fs::write(stale.join("old.toml"), "mode = \"deny_all\"\n").unwrap();
    symlink("..2026_12_03_06_00_00.000000001", dir.join("..data_tmp")).unwrap();

    let files = read_policies(&dir).unwrap();
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(files[0].name, "web");
    assert_eq!(files[0].text, "mode = \"allow_all\"\n");
    assert_eq!(
        files[0].path,
        dir.join("web.toml"),
        "errors name the key's path"
    );

    // An update: the new version's files, the removed key gone, nothing read twice.
    std::fs::remove_file(dir.join("..data_tmp")).unwrap();
    std::fs::remove_dir_all(&stale).unwrap();
    kubelet::update(
        &dir,
        "2026_12_03_07_05_00.000000002",
        &[
            ("web.toml", "mode = \"deny_all\"\n"),
            ("ci.toml", "mode = \"allow_all\"\n"),
        ],
    )
    .unwrap();
    assert_eq!(
        names_and_texts(&dir),
        [
            ("ci".to_owned(), "mode = \"allow_all\"\n".to_owned()),
            ("web".to_owned(), "mode = \"deny_all\"\n".to_owned())
        ]
    );
    assert!(!dir.join(format!("..{}", kubelet::FIRST)).exists());
    std::fs::remove_dir_all(&d).ok();
}

/// Plain directories keep refusing links; a `..data` that leaves the directory is refused; a
/// `..data` that is not a link is just a dot-entry.
#[test]
fn links_out_of_the_directory_are_refused() {
    let d = kubelet::tempdir("k8s-links");
    let dir = d.join(DIR_NAME);
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(d.join("elsewhere.toml"), "mode = \"allow_all\"\n").unwrap();
    symlink(d.join("elsewhere.toml"), dir.join("web.toml")).unwrap();
    let e = read_policies(&dir).unwrap_err().to_string();
    assert!(e.contains("web.toml") && e.contains("symbolic link"), "{e}");
    std::fs::remove_file(dir.join("web.toml")).unwrap();

    symlink("../", dir.join(DATA_LINK)).unwrap();
    let e = read_policies(&dir).unwrap_err().to_string();
    assert!(e.contains("..data") && e.contains("points at"), "{e}");
    std::fs::remove_file(dir.join(DATA_LINK)).unwrap();

    std::fs::create_dir(dir.join(DATA_LINK)).unwrap();
    std::fs::write(dir.join(DATA_LINK).join("x.toml"), "mode = \"allow_all\"\n").unwrap();
    std::fs::write(dir.join("a.toml"), "mode = \"allow_all\"\n").unwrap();
    assert!(!kubernetes_managed(&dir));
    assert_eq!(names_and_texts(&dir).len(), 1);

    // A version directory others can write to is refused like the directory itself.
    let (k8s_dir, k) = kubelet::volume("k8s-loose", &[("a.toml", "mode = \"allow_all\"\n")]);
    std::fs::set_permissions(
        k.join(format!("..{}", kubelet::FIRST)),
        std::fs::Permissions::from_mode(0o777),
    )
    .unwrap();
    let e = read_policies(&k).unwrap_err().to_string();
    assert!(e.contains("writable by group or others"), "{e}");
    std::fs::remove_dir_all(&d).ok();
    std::fs::remove_dir_all(&k8s_dir).ok();
}

#[test]
fn policy_names_skip_dot_entries() {
    for skipped in [
        "..data",
        "..data_tmp",
        "..2026_12_03_07_00_00.1",
        ".ci.toml.swp",
        "ci.toml~",
        "README",
    ] {
        assert_eq!(policy_name(skipped), None, "{skipped}");
    }
    assert_eq!(policy_name("ci.toml"), Some("ci"));
}
