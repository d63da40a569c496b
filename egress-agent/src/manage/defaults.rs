//! `agent.default_policy` and `agent.unlabeled` live in the main file's `[agent]` table; a
//! change edits those two keys in place (`toml_edit`: every other byte, comments included, stays
//! as the operator wrote it).
use std::path::Path;

use toml_edit::{DocumentMut, Item, Table, value};

use super::ManageError;
use crate::config::ConfigError;

/// `text` with the given keys of `[agent]` set (the table is created if missing).
pub fn set(
    text: &str,
    path: &Path,
    default_policy: Option<&str>,
    unlabeled: Option<&str>,
) -> Result<String, ManageError> {
    let mut doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        ManageError::Invalid(ConfigError::Invalid {
            path: path.to_owned(),
            line: 0,
            column: 0,
            field: "-".to_owned(),
            message: e.message().to_owned(),
        })
    })?;
    let agent = doc
        .entry("agent")
        .or_insert_with(|| Item::Table(Table::new()));
    let Some(agent) = agent.as_table_like_mut() else {
        return Err(ManageError::Conflict(format!(
            "{}: `agent` is not a table; fix the file by hand",
            path.display()
        )));
    };
    for (key, v) in [("default_policy", default_policy), ("unlabeled", unlabeled)] {
        let Some(v) = v else { continue };
        match agent.get_mut(key) {
            // Keep the key (and the comments before it) and the value's own decor.
            Some(Item::Value(old)) => {
                let decor = old.decor().clone();
                let mut new = toml_edit::Value::from(v);
                *new.decor_mut() = decor;
                *old = new;
            }
            _ => {
                agent.insert(key, value(v));
            }
        }
    }
    Ok(doc.to_string())
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    #[test]
    fn keys_are_set_in_place_and_comments_stay() {
        let text = "# the agent\n[agent]\n# who gets what\ndefault_policy = \"deny_all\" # safe\nbpffs = \"/sys/fs/bpf/x\"\n\n[policies.ci]\nmode = \"allow_all\"\n";
        let out = set(text, Path::new("c.toml"), Some("ci"), None).unwrap();
        assert!(
            out.contains("# the agent\n[agent]\n# who gets what\n"),
            "{out}"
        );
        assert!(out.contains("default_policy = \"ci\" # safe"), "{out}");
        assert!(out.contains("bpffs = \"/sys/fs/bpf/x\""), "{out}");
        assert!(!out.contains("unlabeled"), "{out}");
        let out = set(&out, Path::new("c.toml"), None, Some("deny_all")).unwrap();
        assert!(out.contains("unlabeled = \"deny_all\""), "{out}");
    }

    #[test]
    fn a_missing_agent_table_is_created() {
        let out = set(
            "[proxy]\nendpoint = \"127.0.0.1:3128\"\n",
            Path::new("c.toml"),
            Some("audit"),
            Some("allow_all"),
        )
        .unwrap();
        let v: toml::Table = toml::from_str(&out).unwrap();
        assert_eq!(v["agent"]["default_policy"].as_str(), Some("audit"));
        assert_eq!(v["agent"]["unlabeled"].as_str(), Some("allow_all"));
        assert_eq!(v["proxy"]["endpoint"].as_str(), Some("127.0.0.1:3128"));
    }
}
