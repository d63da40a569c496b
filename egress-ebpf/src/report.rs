//! Verdicts with their bookkeeping: per-cgroup counters and denial events.

use crate::maps::{COUNTERS, EVENTS};
use crate::{ALLOW, DENY};
use aya_ebpf::helpers::generated::{bpf_get_current_cgroup_id, bpf_ktime_get_ns};
use aya_ebpf::helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid};
use egress_common::{
    Counters, EVENT_FLAG_ALLOWED, EVENT_FLAG_AUDIT, Event, POLICY_FLAG_AUDIT, PolicyEntry,
};

const C_ALLOWED: u32 = 0;
const C_DENIED: u32 = 1;
pub(crate) const C_PROXIED: u32 = 2;
const C_LOST: u32 = 3;

#[inline(always)]
pub(crate) fn count(cgroup_id: u64, which: u32) {
    let mut ptr = COUNTERS.get_ptr_mut(&cgroup_id);
    if ptr.is_none() {
        // A full map only loses statistics, never a verdict.
        let _ = COUNTERS.insert(&cgroup_id, &Counters::default(), 1 /* BPF_NOEXIST */);
        ptr = COUNTERS.get_ptr_mut(&cgroup_id);
    }
    if let Some(c) = ptr {
        // SAFETY: per-CPU value, valid for the program's run; no concurrent writer on this CPU.
        unsafe {
            match which {
                C_ALLOWED => (*c).allowed += 1,
                C_DENIED => (*c).denied += 1,
                C_PROXIED => {
                    (*c).allowed += 1;
                    (*c).proxied += 1
                }
                _ => (*c).events_lost += 1,
            }
        }
    }
}

pub(crate) struct Dst {
    pub(crate) family: u32,
    pub(crate) protocol: u32,
    /// Host byte order.
    pub(crate) port: u16,
    pub(crate) addr: [u32; 4],
}

/// Count a denial and emit its event; returns the DENY verdict. For refusals under a policy,
/// use [`refuse`] (audit).
#[inline(always)]
pub(crate) fn deny(cgroup_id: u64, hook: u32, reason: u32, dst: &Dst, with_task: bool) -> i32 {
    count(cgroup_id, C_DENIED);
    emit(cgroup_id, hook, reason, dst, with_task, 0);
    DENY
}

/// What policy `p` refuses: denied — or, when the policy audits (`enforce = "audit"`), allowed
/// and reported as a would-deny (`EVENT_FLAG_AUDIT`).
#[inline(always)]
pub(crate) fn refuse(
    p: &PolicyEntry,
    cgroup_id: u64,
    hook: u32,
    reason: u32,
    dst: &Dst,
    with_task: bool,
) -> i32 {
    if p.flags & POLICY_FLAG_AUDIT == 0 {
        return deny(cgroup_id, hook, reason, dst, with_task);
    }
    count(cgroup_id, C_ALLOWED);
    emit(cgroup_id, hook, reason, dst, with_task, EVENT_FLAG_AUDIT);
    ALLOW
}

/// What policy `p` allows directly: counted — and, when the policy audits, reported
/// (`EVENT_FLAG_ALLOWED`) so the full picture of a watched workload exists.
#[inline(always)]
pub(crate) fn allow_direct(p: &PolicyEntry, cgroup_id: u64, hook: u32, dst: &Dst) -> i32 {
    if p.flags & POLICY_FLAG_AUDIT != 0 {
        emit(cgroup_id, hook, 0, dst, true, EVENT_FLAG_ALLOWED);
    }
    allow(cgroup_id)
}

#[inline(always)]
fn emit(cgroup_id: u64, hook: u32, reason: u32, dst: &Dst, with_task: bool, flags: u16) {
    let (pid, comm, task_cgroup_id) = if with_task {
        (
            (bpf_get_current_pid_tgid() >> 32) as u32,
            bpf_get_current_comm().unwrap_or([0u8; 16]),
            // SAFETY: helper without arguments.
            unsafe { bpf_get_current_cgroup_id() },
        )
    } else {
        (0, [0u8; 16], 0)
    };
    let event = Event {
        // SAFETY: helper without arguments.
        ktime_ns: unsafe { bpf_ktime_get_ns() },
        cgroup_id,
        pid,
        hook,
        family: dst.family,
        protocol: dst.protocol,
        port: dst.port,
        flags,
        reason,
        addr: dst.addr,
        comm,
        task_cgroup_id,
    };
    if EVENTS.output::<Event>(&event, 0).is_err() {
        count(cgroup_id, C_LOST);
    }
}

#[inline(always)]
pub(crate) fn allow(cgroup_id: u64) -> i32 {
    count(cgroup_id, C_ALLOWED);
    ALLOW
}
