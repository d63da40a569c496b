//! A listener identity's interception sockets: the transparent TCP listener and the DNS
//! responder, bound next to its proxy listener when the context has [`InterceptHooks`].
//!
//! What the kernel side writes into a cgroup's entry comes from [`InterceptAddrs`]
//! ([`super::PolicyProxy::intercept_addrs`]): TCP on `allow_ports` goes to `transparent`, UDP to
//! port 53 to `dns_udp`, TCP to port 53 to `dns_tcp`. Which sockets exist follows the policy at
//! bind time: `transparent` for [`egress_policy::Policy::transparent`], DNS for
//! [`egress_policy::Policy::answers_dns`] (never `deny_all`).
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::admission::Admission;
use super::admission::Listener;
use super::{Shared, accept, listen, transparent};
use crate::proxy::dns::{AnswerSink, DnsResponder};
use egress_policy::Policy;

/// What the kernel side provides to transparent interception and DNS (see docs/architecture.md,
/// "Transparent interception and DNS: kernel interface").
#[derive(Clone)]
pub struct InterceptHooks {
    /// The kernel's records of connections sent to the listeners: who is admitted, and where
    /// redirected connections were going ([`super::admission`]).
    pub admission: Arc<dyn Admission>,
    /// Hears of every DNS answer before it is sent.
    pub answers: Arc<dyn AnswerSink>,
}

impl std::fmt::Debug for InterceptHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterceptHooks").finish_non_exhaustive()
    }
}

pub use egress_policy::kernel::InterceptAddrs;

/// Bound interception sockets of one listener, not yet running.
pub(crate) struct Interception {
    transparent: Option<TcpListener>,
    dns: Option<DnsResponder>,
    addrs: InterceptAddrs,
    /// Offered to a successor while the sockets run.
    held: Vec<crate::handover::Held>,
}

impl Interception {
    /// Bind what `policy` needs on `ip` for the listener `shared` belongs to.
    pub(crate) async fn bind(
        ip: IpAddr,
        shared: &Arc<Shared>,
        hooks: &InterceptHooks,
        policy: &Policy,
    ) -> io::Result<Interception> {
        let mut addrs = InterceptAddrs::default();
        let mut held = Vec::new();
        let transparent = if policy.transparent() {
            let (l, h) = listen::listen_as(
                &shared.ctx,
                shared.socket_key("transparent"),
                SocketAddr::new(ip, 0),
            )?;
            held.extend(h);
            addrs.transparent = Some(l.local_addr()?);
            Some(l)
        } else {
            None
        };
        let dns = if policy.answers_dns() {
            let d =
                DnsResponder::bind(ip, shared.clone(), hooks.answers.clone(), &mut held).await?;
            addrs.dns_udp = Some(d.udp_addr());
            addrs.dns_tcp = Some(d.tcp_addr());
            Some(d)
        } else {
            None
        };
        Ok(Interception {
            transparent,
            dns,
            addrs,
            held,
        })
    }

    pub(crate) fn addrs(&self) -> InterceptAddrs {
        self.addrs
    }

    /// Run the sockets on tasks of their own (kept by the listener's tracker): accepting until
    /// `accepting` is cancelled, their connections until `stop` is.
    pub(crate) fn spawn(
        self,
        shared: &Arc<Shared>,
        stop: &CancellationToken,
        accepting: &CancellationToken,
    ) {
        let held = Arc::new(self.held);
        if let Some(dns) = self.dns {
            let held = held.clone();
            let run = dns.run(accepting.clone(), stop.clone());
            shared.tasks.spawn(async move {
                run.await;
                drop(held);
            });
        }
        if let Some(l) = self.transparent {
            let accept = accept::accept_loop(
                l,
                shared.clone(),
                accepting.clone().cancelled_owned(),
                stop.clone(),
                Listener::Transparent,
                |stream, peer, shared, stop, slot| async move {
                    let Some(admitted) = slot.admit(&shared, peer) else {
                        return;
                    };
                    transparent::handle(stream, peer, admitted, &shared, stop).await;
                    drop(slot);
                },
            );
            shared.tasks.spawn(async move {
                accept.await;
                drop(held);
            });
        }
    }
}
