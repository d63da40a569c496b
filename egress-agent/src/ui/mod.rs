//! The status page: a small read-only HTML + JS + CSS page served by the daemon on the control
//! socket (and on `api.ui_listen`), with no external assets. It reads the GET endpoints
//! (`/v1/status`, `/v1/containers`, `/v1/policies`, `/v1/defaults`, `/v1/events`, `/v1/doctor`)
//! and follows `/v1/events/sse` for live denials. Everything it shows is inserted as text
//! (`textContent`), never as markup; the Content-Security-Policy allows only its own files.

/// The page's Content-Security-Policy: its own script, style and connections, nothing else.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

const INDEX: &str = include_str!("index.html");
const APP_JS: &str = include_str!("app.js");
const APP_CSS: &str = include_str!("app.css");

/// A file of the page by name (`""` is `index.html`): content type and body.
pub fn asset(name: &str) -> Option<(&'static str, &'static str)> {
    match name {
        "" | "index.html" => Some(("text/html; charset=utf-8", INDEX)),
        "app.js" => Some(("text/javascript; charset=utf-8", APP_JS)),
        "app.css" => Some(("text/css; charset=utf-8", APP_CSS)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        for (_, body) in ["", "app.js", "app.css"].iter().filter_map(|n| asset(n)) {
            for bad in ["http://", "https://", "//cdn", "innerHTML", "eval("] {
                assert!(!body.contains(bad), "{bad} in an asset");
            }
        }
        assert!(asset("../config.toml").is_none());
        assert!(INDEX.contains("app.js") && INDEX.contains("app.css"));
    }
}
