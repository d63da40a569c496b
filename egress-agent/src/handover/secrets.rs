//! Environment secrets across a hand-over (`source = { env = "VAR" }`).
//!
//! The running agent took each such variable out of its environment ([`crate::secrets`]), so a
//! successor it starts (SIGUSR2, `egress-agent restart`) inherits an environment without it. The
//! running agent passes its env-secret table in the offer instead: each secret is a memfd sealed
//! against writing, growing, shrinking and further seals, named `env-secret/<VAR>`, and travels
//! with the sockets in the same `SCM_RIGHTS` packets — never in a message body, an environment
//! variable or a file on disk. Only a successor the hand-over admits gets them: the running
//! agent refuses a peer that is not root before it offers anything ([`super::give`]).
//!
//! The successor reads each one (only if sealed, whole, at most [`MAX_SECRET`] bytes) and
//! installs it in its own table ([`crate::secrets::install_env`]: the same checks as a variable;
//! a value in its own environment wins) before it resolves its configuration, so no binding of
//! the new agent serves a request without its secret. A secret that can't be read leaves its
//! bindings unavailable (their hosts refused, `status` says why).
//!
//! Both directions of an upgrade keep working: an agent of an earlier build offers no secrets
//! (its successor starts with those bindings unavailable), and a successor of an earlier build
//! adopts the names as unknown sockets and closes them unclaimed.
use std::fs::File;
use std::io::{self, Write as _};
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt as _;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use zeroize::Zeroizing;

/// The offer's name prefix of an env secret (`env-secret/ANTHROPIC_API_KEY`).
pub const PREFIX: &str = "env-secret/";
/// The largest env secret read from a hand-over.
pub const MAX_SECRET: u64 = 64 * 1024;

/// The seals a received secret must carry: nobody (the sender included) can change it.
fn required_seals() -> SealFlag {
    SealFlag::F_SEAL_WRITE | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_SEAL
}

/// Every env secret this process holds, each as a sealed memfd under its offer name.
pub fn offer() -> io::Result<Named> {
    crate::secrets::env_secrets()
        .into_iter()
        .map(|(name, secret)| Ok((format!("{PREFIX}{name}"), sealed(secret.expose())?)))
        .collect()
}

/// A memfd holding `bytes`, sealed.
fn sealed(bytes: &[u8]) -> io::Result<OwnedFd> {
    let fd = memfd_create(
        c"egress-env-secret",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )
    .map_err(io::Error::from)?;
    let mut file = File::from(fd);
    file.write_all(bytes)?;
    fcntl(&file, FcntlArg::F_ADD_SEALS(required_seals())).map_err(io::Error::from)?;
    Ok(OwnedFd::from(file))
}

/// The secret in a received memfd: refused unless sealed and at most [`MAX_SECRET`] bytes.
pub fn read(fd: OwnedFd) -> io::Result<Zeroizing<Vec<u8>>> {
    let seals = fcntl(&fd, FcntlArg::F_GET_SEALS).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a sealed memfd: {e}"),
        )
    })?;
    if !SealFlag::from_bits_truncate(seals).contains(required_seals()) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the memfd is not sealed against changes",
        ));
    }
    let file = File::from(fd);
    let len = file.metadata()?.len();
    if len > MAX_SECRET {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{len} bytes (at most {MAX_SECRET})"),
        ));
    }
    let mut bytes = Zeroizing::new(vec![0u8; usize::try_from(len).unwrap_or(0)]);
    file.read_exact_at(&mut bytes, 0)?;
    Ok(bytes)
}

/// Descriptors by name, as an offer carries them.
pub type Named = Vec<(String, OwnedFd)>;

/// Split a received offer into its sockets and its env secrets (by variable name).
pub fn split(fds: Named) -> (Named, Named) {
    let mut sockets = Vec::new();
    let mut secrets = Vec::new();
    for (name, fd) in fds {
        match name.strip_prefix(PREFIX) {
            Some(var) => secrets.push((var.to_owned(), fd)),
            None => sockets.push((name, fd)),
        }
    }
    (sockets, secrets)
}

/// Install the env secrets of an offer ([`split`]) in this process's table; returns the names
/// installed. A secret this process's own environment holds is taken from there instead; one
/// that can't be read or is refused is logged (by name) and left out: its bindings stay
/// unavailable.
pub fn install(secrets: Named) -> Vec<String> {
    let mut installed = Vec::new();
    for (name, fd) in secrets {
        let result = read(fd)
            .map_err(|e| e.to_string())
            .and_then(|bytes| crate::secrets::install_env(&name, bytes).map_err(|e| e.to_string()));
        match result {
            Ok(true) => installed.push(name),
            Ok(false) => tracing::info!(variable = %name,
                "env secret: this agent's own environment has it; the handed-over value is not used"),
            Err(e) => tracing::warn!(variable = %name, error = %e,
                "env secret from the previous agent refused: its bindings stay unavailable"),
        }
    }
    installed
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;

    /// A secret goes over a hand-over connection as a sealed memfd and comes back whole; the
    /// receiver can't change it and refuses one that isn't sealed.
    #[test]
    fn a_secret_travels_sealed_and_whole() {
        let fd = sealed(b"sk-handed-over-0123").unwrap();
        let (a, b) = crate::handover::wire::Conn::pair().unwrap();
        let t = std::thread::spawn(move || {
            a.send_offer(9, &[(format!("{PREFIX}EGRESS_X"), fd)])
                .unwrap();
        });
        let (_, got) = b.recv_offer().unwrap();
        t.join().unwrap();
        let (sockets, secrets) = split(got);
        assert!(sockets.is_empty());
        assert_eq!(secrets.len(), 1);
        let (name, fd) = secrets.into_iter().next().unwrap();
        assert_eq!(name, "EGRESS_X");
        let mut f = File::from(fd.try_clone().unwrap());
        assert!(
            f.write_all(b"changed").is_err(),
            "a sealed secret was writable"
        );
        assert_eq!(&read(fd).unwrap()[..], b"sk-handed-over-0123");

        let unsealed =
            memfd_create(c"x", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).unwrap();
        File::from(unsealed.try_clone().unwrap())
            .write_all(b"x")
            .unwrap();
        assert!(read(unsealed).unwrap_err().to_string().contains("sealed"));
        let socket = OwnedFd::from(std::net::UdpSocket::bind("127.0.0.1:0").unwrap());
        assert!(read(socket).is_err());
    }

    #[test]
    fn an_offer_splits_into_sockets_and_secrets() {
        let s = || OwnedFd::from(std::net::UdpSocket::bind("127.0.0.1:0").unwrap());
        let (sockets, secrets) = split(vec![
            ("api".into(), s()),
            (format!("{PREFIX}A"), s()),
            ("workload/x/1/p/proxy".into(), s()),
        ]);
        let names: Vec<&str> = sockets.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["api", "workload/x/1/p/proxy"]);
        assert_eq!(secrets[0].0, "A");
    }

    /// What a successor installs is what `{ env = … }` then loads.
    #[test]
    fn installed_secrets_resolve_env_sources() {
        let var = "EGRESS_TEST_HANDED_OVER_ENV";
        let got = install(vec![(
            var.to_owned(),
            sealed(b"sk-from-the-old-agent").unwrap(),
        )]);
        assert_eq!(got, [var]);
        let s = crate::secrets::load(&crate::secrets::SecretSource::Env(var.into())).unwrap();
        assert_eq!(s.expose(), b"sk-from-the-old-agent");
        assert!(
            offer()
                .unwrap()
                .iter()
                .any(|(n, _)| *n == format!("{PREFIX}{var}")),
            "a successor of this agent would not get it"
        );
        // Refused values are left out.
        assert!(install(vec![("EGRESS_TEST_EMPTY_HO".into(), sealed(b"").unwrap())]).is_empty());
    }
}
