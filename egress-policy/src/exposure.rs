//! Real keys in a workload's environment (issue #40, item 6): the one decision, pure.
//!
//! Credential bindings work only if the workload holds a placeholder. A workload that was given
//! the real key anyway — the bound secret itself, or a provider's key in the variable its SDK
//! reads — can spend it on any host its policy allows, and no binding, rule or scrubber sees it.
//! [`findings`] says which variables of an environment hold such a key:
//!
//! - **`bound-secret`**: the value is the loaded secret of a credential binding of **any**
//!   policy (a secret bound in policy A shown to a workload of policy B leaks all the same), or
//!   contains one that is at least [`MIN_CONTAINED`] bytes long (a key inside a URL, a JSON
//!   blob, `Bearer <key>`). Shorter secrets only match the whole value: a short string inside a
//!   longer value is too often a coincidence. Compared in constant time for a given length (no
//!   early exit on the first differing byte).
//! - **`provider-variable`**: the variable is one of [`PROVIDER_VARIABLES`] (a name an SDK or
//!   CLI reads its key from) and holds anything but a placeholder.
//!
//! Never a finding: an empty value, and a value equal to a configured placeholder (of any
//! binding, in any policy). A [`Finding`] names the variable and why — never the value, which
//! is not kept anywhere in it.

use std::fmt;

use crate::model::Policy;
use crate::secret::Secret;

/// A bound secret at least this long is also found inside a longer value.
pub const MIN_CONTAINED: usize = 12;

/// Values longer than this are not searched: Linux refuses an environment string longer than
/// `MAX_ARG_STRLEN` (32 pages, 128 KiB) at `execve`, so no process can hold one.
pub const MAX_VALUE: usize = 128 * 1024;

/// Variables SDKs and CLIs read a provider's key or token from, by name (exact, case-sensitive,
/// as the tools read them). A variable that names a *file* or an *id* (`GOOGLE_APPLICATION_CREDENTIALS`,
/// `AWS_ACCESS_KEY_ID`) is not a key and is not listed.
pub const PROVIDER_VARIABLES: &[&str] = &[
    // Model providers: what the AI agents this project confines read first.
    "ANTHROPIC_API_KEY",      // Anthropic SDKs, Claude Code
    "ANTHROPIC_AUTH_TOKEN",   // Claude Code: a bearer token instead of the API key
    "OPENAI_API_KEY",         // OpenAI SDKs, Codex CLI, most OpenAI-compatible clients
    "AZURE_OPENAI_API_KEY",   // the OpenAI SDKs' Azure client, LangChain
    "GEMINI_API_KEY",         // google-genai SDK, Gemini CLI
    "GOOGLE_API_KEY",         // google-genai / google-generativeai SDKs, LangChain
    "MISTRAL_API_KEY",        // Mistral SDKs
    "GROQ_API_KEY",           // Groq SDKs
    "CO_API_KEY",             // Cohere SDKs
    "COHERE_API_KEY",         // LangChain's Cohere integration
    "DEEPSEEK_API_KEY",       // DeepSeek (OpenAI-compatible clients, LiteLLM)
    "XAI_API_KEY",            // xAI SDK
    "OPENROUTER_API_KEY",     // OpenRouter (aider, LiteLLM)
    "TOGETHER_API_KEY",       // Together SDK
    "FIREWORKS_API_KEY",      // Fireworks SDK
    "PERPLEXITY_API_KEY",     // Perplexity (LiteLLM, LangChain)
    "HF_TOKEN",               // huggingface_hub, transformers, datasets
    "HUGGING_FACE_HUB_TOKEN", // huggingface_hub's older name, still read
    // Code hosts: what a CI job or a coding agent pushes with.
    "GITHUB_TOKEN",            // gh CLI, GitHub Actions' token, octokit
    "GH_TOKEN",                // gh CLI (wins over GITHUB_TOKEN)
    "GH_ENTERPRISE_TOKEN",     // gh CLI on GitHub Enterprise Server
    "GITHUB_ENTERPRISE_TOKEN", // gh CLI on GitHub Enterprise Server
    "GITLAB_TOKEN",            // glab CLI, python-gitlab
    "CI_JOB_TOKEN",            // GitLab CI's job token (API, registry, packages)
    // Package registries: publishing tokens.
    "NPM_TOKEN",            // the usual `${NPM_TOKEN}` of an .npmrc
    "NODE_AUTH_TOKEN",      // actions/setup-node's .npmrc
    "CARGO_REGISTRY_TOKEN", // cargo publish
    "TWINE_PASSWORD",       // twine upload (an API token on PyPI)
    "UV_PUBLISH_TOKEN",     // uv publish
    // Clouds: the secret halves of their credentials.
    "AWS_SECRET_ACCESS_KEY", // every AWS SDK and the CLI
    "AWS_SESSION_TOKEN",     // every AWS SDK and the CLI (temporary credentials)
    "AZURE_CLIENT_SECRET",   // azure-identity's EnvironmentCredential
];

/// Is `name` one of [`PROVIDER_VARIABLES`]?
pub fn is_provider_variable(name: &str) -> bool {
    PROVIDER_VARIABLES.contains(&name)
}

/// One loaded secret of a credential binding, and where it is bound.
#[derive(Debug, Clone)]
pub struct BoundSecret<'a> {
    /// `policies.<name>.credentials[<i>]`.
    pub binding: String,
    pub secret: &'a Secret,
}

/// What the environment is compared with: every loaded secret and every placeholder of the
/// configuration's credential bindings.
#[derive(Debug, Clone, Default)]
pub struct Known<'a> {
    pub secrets: Vec<BoundSecret<'a>>,
    pub placeholders: Vec<&'a str>,
}

impl<'a> Known<'a> {
    /// The bindings of every policy (`(name, policy)`); bindings whose secret is not loaded
    /// contribute their placeholder only.
    pub fn of(policies: impl IntoIterator<Item = (&'a str, &'a Policy)>) -> Known<'a> {
        let mut known = Known::default();
        for (name, policy) in policies {
            for (i, b) in policy.credentials.iter().enumerate() {
                if let Some(secret) = &b.secret {
                    known.secrets.push(BoundSecret {
                        binding: format!("policies.{name}.credentials[{i}]"),
                        secret,
                    });
                }
                if let Some(ph) = b.placeholder.as_deref().filter(|p| !p.is_empty()) {
                    known.placeholders.push(ph);
                }
            }
        }
        known
    }
}

/// Why a variable is a finding.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Why {
    /// It holds the loaded secret of this binding (`policies.<name>.credentials[<i>]`).
    BoundSecret(String),
    /// A provider's key variable ([`PROVIDER_VARIABLES`]) holding something but a placeholder.
    ProviderVariable,
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::BoundSecret(binding) => write!(f, "bound-secret {binding}"),
            Why::ProviderVariable => f.write_str("provider-variable"),
        }
    }
}

/// A variable that holds a real key: its name and why. Never its value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Finding {
    pub variable: String,
    pub why: Why,
}

impl fmt::Display for Finding {
    /// `OPENAI_API_KEY (provider-variable)`, `TOKEN (bound-secret policies.ci.credentials[0])`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.variable, self.why)
    }
}

/// Equal bytes, in time that depends only on the lengths.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Does `value` hold `secret` (whole, or inside it when the secret is long enough)? Every
/// window is compared in full: the time depends on the lengths only.
fn holds(value: &[u8], secret: &[u8]) -> bool {
    if secret.is_empty() || value.len() < secret.len() {
        return false;
    }
    if value.len() == secret.len() || secret.len() < MIN_CONTAINED {
        return ct_eq(value, secret);
    }
    value
        .windows(secret.len())
        .fold(false, |found, w| found | ct_eq(w, secret))
}

/// The variables of `env` (name, value) that hold a real key, in `env`'s order, one finding per
/// variable (a bound secret wins over the provider list: it names the binding). Values are
/// compared, never copied into the result.
#[must_use = "a workload holding a real key must be reported"]
pub fn findings<'v>(
    env: impl IntoIterator<Item = (&'v str, &'v [u8])>,
    known: &Known<'_>,
) -> Vec<Finding> {
    let mut out = Vec::new();
    for (name, value) in env {
        if value.is_empty()
            || value.len() > MAX_VALUE
            || known.placeholders.iter().any(|p| p.as_bytes() == value)
        {
            continue;
        }
        let bound = known
            .secrets
            .iter()
            .find(|b| holds(value, b.secret.expose()));
        let why = match bound {
            Some(b) => Why::BoundSecret(b.binding.clone()),
            None if is_provider_variable(name) => Why::ProviderVariable,
            None => continue,
        };
        out.push(Finding {
            variable: name.to_owned(),
            why,
        });
    }
    out
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    const SECRET: &str = "sk-bound-Qp4Zr8Wm2Xv6";
    const OTHER: &str = "gh-other-Tn3Lk7Bd1Fs5";
    const PH: &str = "egress-placeholder-anthropic";

    fn policy(secret: Option<&str>, placeholder: &str) -> Policy {
        let mut p: Policy = toml::from_str(&format!(
            "allow_hosts = [\"api.test\"]\n[[credentials]]\nhost = \"api.test\"\nheader = \"x-api-key\"\nsource = {{ env = \"X\" }}\nplaceholder = \"{placeholder}\"\n"
        ))
        .unwrap();
        p.credentials[0].secret = secret.map(|s| Secret::new(s.as_bytes().to_vec()));
        p
    }

    fn check(env: &[(&str, &str)], policies: &[(&str, &Policy)]) -> Vec<Finding> {
        let known = Known::of(policies.iter().map(|(n, p)| (*n, *p)));
        findings(env.iter().map(|(k, v)| (*k, v.as_bytes())), &known)
    }

    #[test]
    fn a_bound_secret_of_any_policy_is_found_by_its_binding() {
        let a = policy(Some(SECRET), PH);
        let b = policy(Some(OTHER), "egress-ph-b");
        let f = check(
            &[("PATH", "/usr/bin"), ("MY_KEY", SECRET), ("B_KEY", OTHER)],
            &[("a", &a), ("b", &b)],
        );
        assert_eq!(
            f,
            vec![
                Finding {
                    variable: "MY_KEY".into(),
                    why: Why::BoundSecret("policies.a.credentials[0]".into())
                },
                Finding {
                    variable: "B_KEY".into(),
                    why: Why::BoundSecret("policies.b.credentials[0]".into())
                },
            ]
        );
        // In a provider variable the binding is named (more precise than the list).
        let f = check(&[("ANTHROPIC_API_KEY", SECRET)], &[("a", &a)]);
        assert_eq!(
            f[0].to_string(),
            "ANTHROPIC_API_KEY (bound-secret policies.a.credentials[0])"
        );
    }

    /// Decided: a secret of at least MIN_CONTAINED bytes is found inside a longer value (a URL,
    /// `Bearer <key>`, JSON); a shorter one only as the whole value; a value that is only part
    /// of the secret is no finding.
    #[test]
    fn contained_secrets_are_found_when_long_enough() {
        let a = policy(Some(SECRET), PH);
        for v in [
            format!("https://user:{SECRET}@git.example/x"),
            format!("Bearer {SECRET}"),
            format!("{{\"key\":\"{SECRET}\"}}"),
            format!("{SECRET}\n"),
        ] {
            assert_eq!(check(&[("CFG", &v)], &[("a", &a)]).len(), 1, "{v}");
        }
        assert!(check(&[("CFG", &SECRET[..10])], &[("a", &a)]).is_empty());
        let short = policy(Some("k3y-5hort"), PH);
        assert!(check(&[("V", "xk3y-5hortx")], &[("s", &short)]).is_empty());
        assert_eq!(check(&[("V", "k3y-5hort")], &[("s", &short)]).len(), 1);
    }

    #[test]
    fn provider_variables_hold_placeholders_or_nothing() {
        let a = policy(Some(SECRET), PH);
        let none: &[(&str, &Policy)] = &[];
        let f = check(
            &[
                ("OPENAI_API_KEY", "sk-real-key-from-the-dashboard"),
                ("ANTHROPIC_API_KEY", PH), // a placeholder: fine
                ("GITHUB_TOKEN", ""),      // empty: fine
                ("openai_api_key", "sk-lower-case-is-not-read"),
                ("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE"), // an id, not a key
            ],
            &[("a", &a)],
        );
        assert_eq!(
            f,
            vec![Finding {
                variable: "OPENAI_API_KEY".into(),
                why: Why::ProviderVariable
            }]
        );
        // Any configured placeholder is fine, whatever variable holds it; without bindings
        // every non-empty provider variable is a finding.
        assert!(check(&[("GH_TOKEN", PH)], &[("a", &a)]).is_empty());
        assert_eq!(check(&[("GH_TOKEN", PH)], none).len(), 1);
        // A placeholder equal to nothing loaded still counts (the binding's secret may be
        // unavailable).
        let unloaded = policy(None, "egress-ph-unloaded");
        assert!(check(&[("HF_TOKEN", "egress-ph-unloaded")], &[("u", &unloaded)]).is_empty());
    }

    #[test]
    fn findings_name_variables_never_values() {
        let a = policy(Some(SECRET), PH);
        let f = check(
            &[("LEAK", SECRET), ("OPENAI_API_KEY", "sk-provider-value-77")],
            &[("a", &a)],
        );
        let shown = format!(
            "{f:?} {}",
            f.iter().map(|x| x.to_string()).collect::<String>()
        );
        assert!(
            shown.contains("LEAK") && shown.contains("OPENAI_API_KEY"),
            "{shown}"
        );
        assert!(
            !shown.contains(SECRET) && !shown.contains("sk-provider-value-77"),
            "{shown}"
        );
        let known = Known::of([("a", &a)]);
        assert!(!format!("{known:?}").contains(SECRET), "{known:?}");
    }

    #[test]
    fn oversized_values_are_not_searched_and_the_table_is_clean() {
        let a = policy(Some(SECRET), PH);
        let big = format!("{}{SECRET}", "x".repeat(MAX_VALUE));
        assert!(check(&[("BIG", &big)], &[("a", &a)]).is_empty());
        let mut names = PROVIDER_VARIABLES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), PROVIDER_VARIABLES.len(), "duplicate entry");
        assert!(PROVIDER_VARIABLES.iter().all(|n| {
            n.bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        }));
    }
}
