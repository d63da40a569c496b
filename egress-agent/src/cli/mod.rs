//! The command-line views that talk to a running agent (its control API) or read its store:
//! `events`, `suggest`, `policy`, `explain`, `wire` (the `docker run` flags of a policy) and
//! `console` (the console's tokens), `presets` (the built-in presets). They sit above every domain module (nothing but
//! `main.rs` uses them), so domain modules never depend on the API client.
pub mod console;
pub mod events;
pub mod manage;
pub mod presets;
pub mod requests;
pub mod wire;
