//! The command-line views that talk to a running agent (its control API) or read its store:
//! `events`, `suggest`, `policy`, `explain`. They sit above every domain module (nothing but
//! `main.rs` uses them), so domain modules never depend on the API client.
pub mod events;
pub mod manage;
