//! External tools: found on [`Options::tool_path`](super::Options::tool_path), run with a timeout,
//! killed if they overrun. A missing tool is reported as such (the probe then says `skip`).

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;

use super::Ctx;

/// Why a tool could not give an answer.
#[derive(Debug, thiserror::Error)]
pub(super) enum ToolError {
    #[error("`{0}` not found on PATH")]
    NotFound(String),
    #[error("`{0}` did not finish within {ms}ms", ms = .1.as_millis())]
    TimedOut(String, std::time::Duration),
    #[error("`{0}` failed: {1}")]
    Failed(String, String),
}

/// Look `name` up on the configured PATH (never a relative PATH entry).
pub(super) fn find(ctx: &Ctx, name: &str) -> Option<PathBuf> {
    let path = match &ctx.opts.tool_path {
        Some(p) => p.clone(),
        None => std::env::var_os("PATH")?,
    };
    crate::host_tool::find_on(&path, name)
}

/// Run `name args...` with stdin closed, a minimal environment, and the probe timeout (minus a margin).
pub(super) async fn run(ctx: &Arc<Ctx>, name: &str, args: &[&str]) -> Result<String, ToolError> {
    let exe = find(ctx, name).ok_or_else(|| ToolError::NotFound(name.into()))?;
    let limit = ctx.opts.probe_timeout.mul_f32(0.8);
    let child = tokio::process::Command::new(&exe)
        .args(args)
        .env_clear()
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| ToolError::Failed(name.into(), e.to_string()))?;
    let out = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .map_err(|_| ToolError::TimedOut(name.into(), limit))?
        .map_err(|e| ToolError::Failed(name.into(), e.to_string()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let first = err.lines().next().unwrap_or("").trim();
        return Err(ToolError::Failed(
            name.into(),
            format!("{} ({first})", out.status),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
