//! A client stream with bytes already read (after a CONNECT head, or a peeked ClientHello)
//! replayed first, and an activity clock for the idle timeout.
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::tunnel::Activity;

pub struct Prefixed<C> {
    prefix: Vec<u8>,
    pos: usize,
    inner: C,
    activity: Arc<Activity>,
}

impl<C> Prefixed<C> {
    pub fn new(prefix: Vec<u8>, inner: C) -> Prefixed<C> {
        Prefixed {
            prefix,
            pos: 0,
            inner,
            activity: Arc::new(Activity::new()),
        }
    }

    pub(crate) fn activity(&self) -> Arc<Activity> {
        self.activity.clone()
    }

    /// What is left of the prefix (not yet read), and the stream.
    pub(crate) fn into_parts(mut self) -> (Vec<u8>, C) {
        let rest = self.prefix.split_off(self.pos);
        (rest, self.inner)
    }
}

impl<C: AsyncRead + Unpin> AsyncRead for Prefixed<C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.pos < this.prefix.len() {
            let n = (this.prefix.len() - this.pos).min(buf.remaining());
            buf.put_slice(&this.prefix[this.pos..this.pos + n]);
            this.pos += n;
            if this.pos == this.prefix.len() {
                this.prefix = Vec::new();
                this.pos = 0;
            }
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.touch();
        }
        r
    }
}

impl<C: AsyncWrite + Unpin> AsyncWrite for Prefixed<C> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
