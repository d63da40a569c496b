//! Bytes in, bytes out, for both transports: [`read`] a query off the wire (hickory's parser),
//! [`fits`] an answer in the client's payload, [`encode`] the response. Pure (the fuzz target
//! `fuzz/fuzz_targets/dns_query.rs` drives them with arbitrary bytes).
//!
//! What is answered at all: fewer than 12 bytes (no header) are dropped; a response (QR=1) is
//! dropped, even when its body doesn't parse (against reflection loops); a query whose header
//! parses but whose body doesn't gets FORMERR with its id and no question.
use std::net::{IpAddr, SocketAddr};

use hickory_server::net::xfer::Protocol;
use hickory_server::proto::op::{Edns, Header, HeaderCounts, MessageType, Metadata, ResponseCode};
use hickory_server::proto::rr::Record;
use hickory_server::proto::rr::rdata::opt::EdnsOption;
use hickory_server::proto::serialize::binary::{
    BinDecodable, BinDecoder, BinEncodable, BinEncoder,
};
use hickory_server::server::Request;
use hickory_server::zone_handler::{MessageRequest, MessageResponseBuilder};

use crate::metrics::DnsDrop;

/// Largest UDP answer offered to EDNS clients (the DNS flag day 2020 value: no fragmentation).
pub const MAX_UDP_PAYLOAD: u16 = 1232;
/// Answers without EDNS (RFC 1035).
pub const PLAIN_UDP_PAYLOAD: u16 = 512;

/// How a query came in: UDP answers are limited to the client's payload (TC beyond it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

impl Transport {
    fn protocol(self) -> Protocol {
        match self {
            Transport::Udp => Protocol::Udp,
            Transport::Tcp => Protocol::Tcp,
        }
    }
}

/// A message read off the wire.
#[derive(Debug)]
#[must_use]
pub enum Read {
    /// A parsed message (still to be [`super::decide`]d: it may be a response, or not a QUERY).
    Message(Box<Request>),
    /// The header parsed, the body didn't: send these bytes (FORMERR, same id).
    FormErr(Vec<u8>),
    /// Send nothing.
    Drop(DnsDrop),
}

/// Whether `src` can be answered at all (hickory-server's rule: not port 0, not an unspecified
/// or broadcast address).
pub fn answerable(src: SocketAddr) -> bool {
    src.port() != 0
        && match src.ip() {
            IpAddr::V4(ip) => !ip.is_unspecified() && !ip.is_broadcast(),
            IpAddr::V6(ip) => !ip.is_unspecified(),
        }
}

/// Parse one message from `src`.
pub fn read(bytes: &[u8], src: SocketAddr, transport: Transport) -> Read {
    let Ok(header) = Header::read(&mut BinDecoder::new(bytes)) else {
        return Read::Drop(DnsDrop::Malformed);
    };
    match Request::from_bytes(bytes.to_vec(), src, transport.protocol()) {
        Ok(request) => Read::Message(Box::new(request)),
        Err(_) if header.metadata.message_type == MessageType::Response => {
            Read::Drop(DnsDrop::Response)
        }
        Err(_) => {
            let mut metadata = Metadata::response_from_request(&header.metadata);
            metadata.response_code = ResponseCode::FormErr;
            let header = Header {
                metadata,
                counts: HeaderCounts::default(),
            };
            let mut out = Vec::with_capacity(12);
            match header.emit(&mut BinEncoder::new(&mut out)) {
                Ok(()) => Read::FormErr(out),
                Err(_) => Read::Drop(DnsDrop::Malformed),
            }
        }
    }
}

/// The EDNS record of the response (the client's payload, clamped to what we send), if the
/// request had one.
fn response_edns(request: &MessageRequest) -> Option<Edns> {
    request.edns.as_ref().map(|req| {
        let mut e = Edns::new();
        e.set_max_payload(req.max_payload().clamp(PLAIN_UDP_PAYLOAD, MAX_UDP_PAYLOAD));
        e
    })
}

/// Most bytes a response to `request` may take on `transport`.
pub fn budget(request: &MessageRequest, transport: Transport) -> usize {
    match (transport, response_edns(request)) {
        (Transport::Udp, Some(e)) => usize::from(e.max_payload()),
        (Transport::Udp, None) => usize::from(PLAIN_UDP_PAYLOAD),
        (Transport::Tcp, _) => usize::from(u16::MAX),
    }
}

/// Upper bound of the encoded size of a response with `records` (no name compression assumed):
/// header, the question, and each record's owner name, fixed fields and data, and an OPT record.
pub fn size_bound(request: &MessageRequest, records: &[Record]) -> usize {
    let question: usize = request
        .queries
        .queries()
        .iter()
        .map(|q| q.name().len() + 2 + 4)
        .sum();
    let answers: usize = records
        .iter()
        .map(|r| {
            let data = match r.data.ip_addr() {
                Some(IpAddr::V4(_)) => 4,
                Some(IpAddr::V6(_)) => 16,
                None => 255 + 2, // a CNAME target: at most one full name
            };
            r.name.len() + 2 + 10 + data
        })
        .sum();
    12 + question + answers + 11
}

/// Whether an answer with `records` fits what `request`'s client takes on `transport`.
pub fn fits(request: &MessageRequest, transport: Transport, records: &[Record]) -> bool {
    size_bound(request, records) <= budget(request, transport)
}

/// What to send for one query: a response code, the records (empty but for NOERROR answers) and
/// whether it was truncated.
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub struct Reply {
    pub code: ResponseCode,
    pub records: Vec<Record>,
    pub truncated: bool,
    /// An Extended DNS Error (RFC 8914) for a refusal: its INFO-CODE and EXTRA-TEXT. Sent only
    /// to a client that sent EDNS.
    pub ede: Option<(u16, String)>,
}

/// RFC 8914 INFO-CODE 15: the name is blocked by the operator's policy.
pub const EDE_BLOCKED: u16 = 15;
/// RFC 8914 INFO-CODE 18: the query is refused (a `deny_all` policy, a refused query type).
pub const EDE_PROHIBITED: u16 = 18;
/// EDNS option code of an Extended DNS Error.
const EDNS_EDE: u16 = 15;
/// Longest EXTRA-TEXT sent (a refusal answer stays far below any client's payload).
const MAX_EDE_TEXT: usize = 200;

impl Reply {
    /// No records, code `code`.
    pub fn code(code: ResponseCode) -> Reply {
        Reply {
            code,
            records: Vec::new(),
            truncated: false,
            ede: None,
        }
    }

    /// A refusal: no records, code `code`, an Extended DNS Error saying why (`text`, cut to
    /// [`MAX_EDE_TEXT`] bytes on a character boundary).
    pub fn refused(code: ResponseCode, text: &str) -> Reply {
        let info = match code {
            ResponseCode::Refused => EDE_PROHIBITED,
            _ => EDE_BLOCKED,
        };
        let mut end = text.len().min(MAX_EDE_TEXT);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        Reply {
            ede: Some((info, text[..end].to_owned())),
            ..Reply::code(code)
        }
    }
}

/// The response to `request` carrying `reply`: the request's id, question and flags, RA set,
/// EDNS with our payload if the request had EDNS. Never larger than [`budget`]: a response that
/// doesn't encode within it (a FORMERR echoing a request's many questions) is sent as the header
/// alone — its code, or SERVFAIL if it carried records.
pub fn encode(request: &MessageRequest, transport: Transport, reply: &Reply) -> Option<Vec<u8>> {
    let mut meta = Metadata::response_from_request(&request.metadata);
    meta.recursion_available = true;
    meta.response_code = reply.code;
    meta.truncation = reply.truncated;
    let mut edns = response_edns(request);
    if let (Some(e), Some((info, text))) = (edns.as_mut(), &reply.ede) {
        let mut data = info.to_be_bytes().to_vec();
        data.extend_from_slice(text.as_bytes());
        e.options_mut().insert(EdnsOption::Unknown(EDNS_EDE, data));
    }
    let max = budget(request, transport);
    let mut builder = MessageResponseBuilder::new(&request.queries, None);
    if let Some(e) = &edns {
        builder.edns(e);
    }
    let none: [&Record; 0] = [];
    let msg = builder.build(meta, reply.records.iter(), none, none, none);
    let mut out = Vec::with_capacity(128);
    let mut enc = BinEncoder::new(&mut out);
    enc.set_max_size(u16::try_from(max).unwrap_or(u16::MAX));
    if msg.destructive_emit(&mut enc).is_ok() {
        return Some(out);
    }
    if !reply.records.is_empty() {
        meta.response_code = ResponseCode::ServFail;
    }
    let header = Header {
        metadata: meta,
        counts: HeaderCounts::default(),
    };
    let mut out = Vec::with_capacity(12);
    header
        .emit(&mut BinEncoder::new(&mut out))
        .ok()
        .map(|()| out)
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "test assertions")]
mod tests {
    use super::*;
    use hickory_server::proto::op::{Message, Query};
    use hickory_server::proto::rr::{Name, RecordType};

    fn request(edns: bool) -> Request {
        let mut m = Message::query();
        m.add_query(Query::query(
            Name::from_ascii("a.test.").unwrap(),
            RecordType::A,
        ));
        if edns {
            m.set_edns(Edns::new());
        }
        let src = "127.0.0.1:5353".parse().unwrap();
        Request::from_bytes(m.to_vec().unwrap(), src, Protocol::Udp).unwrap()
    }

    fn ede(bytes: &[u8]) -> Option<(u16, String)> {
        let m = Message::from_vec(bytes).unwrap();
        m.edns?
            .options()
            .as_ref()
            .iter()
            .find_map(|(code, opt)| match (u16::from(*code), opt) {
                (EDNS_EDE, EdnsOption::Unknown(_, data)) => Some((
                    u16::from_be_bytes([data[0], data[1]]),
                    String::from_utf8(data[2..].to_vec()).unwrap(),
                )),
                _ => None,
            })
    }

    /// A refusal carries its Extended DNS Error to an EDNS client (its text cut on a character
    /// boundary), and nothing extra to a client that sent no EDNS (RFC 6891: no OPT then).
    #[test]
    fn refusals_carry_an_extended_dns_error_to_edns_clients_only() {
        let r = Reply::refused(
            ResponseCode::NXDomain,
            "denied by policy ci: host-not-allowed",
        );
        let out = encode(&request(true), Transport::Udp, &r).unwrap();
        assert_eq!(
            ede(&out),
            Some((
                EDE_BLOCKED,
                "denied by policy ci: host-not-allowed".to_owned()
            ))
        );
        let out = encode(&request(false), Transport::Udp, &r).unwrap();
        assert!(Message::from_vec(&out).unwrap().edns.is_none());
        let long = "é".repeat(150);
        let r = Reply::refused(ResponseCode::Refused, &long);
        let (info, text) = ede(&encode(&request(true), Transport::Udp, &r).unwrap()).unwrap();
        assert_eq!(info, EDE_PROHIBITED);
        assert_eq!(text.len(), MAX_EDE_TEXT);
        assert!(long.starts_with(&text));
    }
}
