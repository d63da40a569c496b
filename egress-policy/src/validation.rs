//! The error every check of a policy returns: the field (a dotted path) and what is wrong with
//! it. Below every module that checks something (`model`, `credentials`, `rules`), so none of
//! them depends on another for it.

/// A semantic error found by a policy's `validate`, before it is located in the source.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ValidationError {
    /// Dotted path, e.g. `policies.ci.deny_cidrs[1]`.
    pub field: String,
    pub message: String,
}

pub fn verr(field: impl Into<String>, message: impl Into<String>) -> ValidationError {
    ValidationError {
        field: field.into(),
        message: message.into(),
    }
}
