//! Policy lookup: the calling (or packet's) cgroup and its ancestors, nearest entry wins.

use crate::maps::POLICIES;
use aya_ebpf::bindings::__sk_buff;
use aya_ebpf::helpers::generated::{
    bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_skb_ancestor_cgroup_id,
    bpf_skb_cgroup_id,
};
use egress_common::{MAX_CGROUP_DEPTH, PolicyEntry};

/// The policy found for a cgroup: the entry and the id of the cgroup it is keyed by.
pub(crate) struct Found {
    pub(crate) cgroup_id: u64,
    pub(crate) entry: *const PolicyEntry,
}

/// Walk ancestors of a cgroup given `ancestor(level)` (0 when `level` is deeper than the cgroup).
/// A binary search finds the cgroup's own level (5 helper calls for 32 levels), then the walk goes
/// up from there: the first entry found is the nearest one.
#[inline(always)]
pub(crate) fn find_policy(ancestor: impl Fn(i32) -> u64) -> Result<Found, u64> {
    // Deepest level with a non-zero ancestor id, in [0, MAX_CGROUP_DEPTH).
    let mut lo: i32 = 0;
    let mut hi: i32 = MAX_CGROUP_DEPTH as i32 - 1;
    for _ in 0..6 {
        if lo >= hi {
            break;
        }
        let mid = (lo + hi + 1) / 2;
        if ancestor(mid) != 0 {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let own = ancestor(lo);
    let mut level = lo;
    for _ in 0..MAX_CGROUP_DEPTH {
        if level < 0 {
            break;
        }
        let id = ancestor(level);
        if id != 0
            && let Some(entry) = POLICIES.get_ptr(&id)
        {
            return Ok(Found {
                cgroup_id: id,
                entry,
            });
        }
        level -= 1;
    }
    Err(own)
}

#[inline(always)]
pub(crate) fn policy_of_current() -> Result<Found, u64> {
    // Fast path: the cgroup itself has the entry (exec-* cgroups, containers).
    // SAFETY: helper without arguments.
    let own = unsafe { bpf_get_current_cgroup_id() };
    if let Some(entry) = POLICIES.get_ptr(&own) {
        return Ok(Found {
            cgroup_id: own,
            entry,
        });
    }
    // SAFETY: helper without pointer arguments.
    find_policy(|level| unsafe { bpf_get_current_ancestor_cgroup_id(level) })
}

#[inline(always)]
pub(crate) fn policy_of_skb(skb: *mut __sk_buff) -> Result<Found, u64> {
    // SAFETY: `skb` is the program context.
    let own = unsafe { bpf_skb_cgroup_id(skb) };
    if let Some(entry) = POLICIES.get_ptr(&own) {
        return Ok(Found {
            cgroup_id: own,
            entry,
        });
    }
    // SAFETY: `skb` is the program context.
    find_policy(|level| unsafe { bpf_skb_ancestor_cgroup_id(skb, level) })
}
