//! Policies for unit tests, from the TOML of one `[policies.NAME]` table (parsed and validated
//! as the agent's configuration does; secrets are left for the test to set).

use crate::Policy;

#[expect(
    clippy::unwrap_used,
    reason = "test helper: a bad test policy is a test bug"
)]
pub(crate) fn policy(toml_text: &str) -> Policy {
    let p: Policy = toml::from_str(toml_text).unwrap();
    p.validate("policies.p").unwrap();
    p
}
