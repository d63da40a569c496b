//! Helpers for the privileged integration tests.
