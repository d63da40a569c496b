//! Taking a secret out of the process environment (the one `unsafe` of [`super`]).
//!
//! `unsetenv(3)` only drops the pointer from `environ`; the `NAME=value` bytes stay where the
//! kernel put them at `execve`, and `/proc/<pid>/environ` reads exactly that region
//! (`mm->env_start..env_end`). So the value is overwritten in place first, then the variable is
//! removed. Environment changes race with other threads reading the environment through libc;
//! this runs while the configuration is loaded (once per variable, at start, before the proxy
//! serves), and Rust's own environment lock is held by `remove_var`.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStringExt;

use zeroize::Zeroizing;

/// The variable's value, now gone from the process environment and from the memory
/// `/proc/self/environ` shows. `None` if unset.
pub(super) fn take_env(name: &str) -> Option<Zeroizing<Vec<u8>>> {
    let value = Zeroizing::new(std::env::var_os(name)?.into_vec());
    let cname = CString::new(name).ok()?;
    // SAFETY: `getenv` returns null or a pointer to the NUL-terminated value inside the live
    // environment block; we write only within `strlen` bytes of it, before removing the entry.
    unsafe {
        let p = libc::getenv(cname.as_ptr());
        if !p.is_null() {
            let len = libc::strlen(p);
            for i in 0..len {
                std::ptr::write_volatile(p.add(i), 0);
            }
        }
        std::env::remove_var(name);
    }
    Some(value)
}
