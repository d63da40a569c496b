//! A client that is not the workload a listener serves (#40 item 1): the attempts every
//! listener-admission test makes, and what they must get (nothing).
use std::net::SocketAddr;

/// The foreign client: for one listener, four attempts; prints `<what>=<bytes received>` (or
/// `<what>=refused:<errno name>` when connect() itself failed). Any byte back is a failure.
pub const FOREIGN_PY: &str = r#"
import socket, ssl, struct, sys
host, port, api_port, ph = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
fam = socket.AF_INET6 if ':' in host else socket.AF_INET

def attempt(name, send, tls=False):
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((host, port))
    except OSError as e:
        print(f"{name}=refused:{e.errno}", flush=True)
        return
    got = b""
    try:
        if tls:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            s = ctx.wrap_socket(s, server_hostname="api.test")
        s.sendall(send)
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
    except (OSError, ssl.SSLError):
        pass
    print(f"{name}={len(got)}", flush=True)

req = (f"GET /v1/foreign HTTP/1.1\r\nHost: api.test:{api_port}\r\n"
       f"Authorization: Bearer {ph}\r\nConnection: close\r\n\r\n").encode()
attempt("connect", f"CONNECT api.test:{api_port} HTTP/1.1\r\nHost: api.test:{api_port}\r\n\r\n".encode())
attempt("http", (f"GET http://api.test:{api_port}/v1/foreign-http HTTP/1.1\r\nHost: api.test:{api_port}\r\n"
                 f"Authorization: Bearer {ph}\r\nConnection: close\r\n\r\n").encode())
q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"\x03api\x04test\x00" + struct.pack(">HH", 1, 1)
attempt("dns", struct.pack(">H", len(q)) + q)
attempt("tls", req, tls=True)
"#;

/// Every attempt of `printed` got nothing: no byte back (or connect() refused).
pub fn got_nothing(who: &str, listener: SocketAddr, printed: &str) {
    for line in printed.lines() {
        let (what, got) = line.split_once('=').expect("what=got");
        assert!(
            got == "0" || got.starts_with("refused:"),
            "{who} got {got} bytes back from {what} at {listener}: {printed}"
        );
    }
}
