//! What `egress-agent suggest` and the API's `/v1/suggest` print for a selection of observed
//! flows: the suggested policy, or its diff against the configured one.
use std::path::PathBuf;

use anyhow::{Result, anyhow, bail};

use crate::config::Config;
use crate::store::query::Flow;
use crate::store::selection::Selection;

/// Options of `egress-agent suggest`.
#[derive(Debug, Clone)]
pub struct SuggestOptions {
    pub selection: Selection,
    pub include_denied: bool,
    pub diff: bool,
    pub name: Option<String>,
    pub config: Option<PathBuf>,
}

/// The text `suggest` prints for `flows` (separate from the store for tests).
pub fn suggest_from(flows: &[Flow], config: &Config, opts: &SuggestOptions) -> Result<String> {
    let mut endpoints = vec![config.proxy.endpoint];
    endpoints.extend(config.proxy.endpoint_v6);
    let observed = super::observe(
        flows,
        &super::Options {
            include_denied: opts.include_denied,
            proxy_endpoints: endpoints,
        },
    );
    let s = super::suggest(&observed);
    if opts.diff {
        let name = match &opts.selection.policy {
            Some(p) => p.clone(),
            None => {
                let mut names: Vec<&str> = flows.iter().map(|f| f.policy.as_str()).collect();
                names.sort_unstable();
                names.dedup();
                match names.as_slice() {
                    [one] => (*one).to_owned(),
                    [] => bail!("--diff: nothing observed for this selection"),
                    many => bail!(
                        "--diff: the selection spans policies {}; name one with --policy",
                        many.join(", ")
                    ),
                }
            }
        };
        let current = config
            .policy(&name)
            .ok_or_else(|| anyhow!("--diff: no policy named {name:?} in the configuration"))?;
        return Ok(super::diff(&s, &observed, current, &name));
    }
    let name = opts
        .name
        .clone()
        .or_else(|| opts.selection.policy.clone())
        .unwrap_or_else(|| "suggested".to_owned());
    let header = super::header(&observed, &opts.selection.describe());
    Ok(super::render(&s, &name, &header))
}
