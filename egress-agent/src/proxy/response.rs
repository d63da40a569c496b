//! Canned responses. Bodies are fixed strings plus the policy's name; nothing from the request is
//! echoed back.
pub const CONNECT_OK: &[u8] = b"HTTP/1.1 200 Connection established\r\n\r\n";

/// 400 / 431 / 502 / 503 with a short plain-text body and an `X-Egress-Error` code.
pub fn error(status: u16, code: &str) -> Vec<u8> {
    let text = match status {
        400 => "Bad Request",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let body = format!("egress-agent: {code}\n");
    format!(
        "HTTP/1.1 {status} {text}\r\nX-Egress-Error: {code}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}
