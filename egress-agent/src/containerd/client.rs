//! containerd's own gRPC API, as the runtime uses it: the event stream, the container records
//! (labels, OCI spec) and task kills. Pods come from these records; the CRI API is not needed.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use containerd_client::services::v1::{
    Container, GetContainerRequest, ListContainersRequest, SubscribeRequest,
    containers_client::ContainersClient, events_client::EventsClient,
};
use containerd_client::tonic::{self, Request, Streaming, transport::Channel};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "cannot connect to containerd at {path}: {source} (is containerd running, and is [kubernetes] containerd_socket right?)"
    )]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("containerd event subscription: {0}")]
    Sync(String),
    #[error("containerd {call}: {status}")]
    Call {
        call: &'static str,
        status: tonic::Status,
    },
}

/// The topic of the agent's own marker event. containerd sends a subscriber nothing — not
/// even the response headers — until the first event, so a subscription can't be known to be
/// live by its call returning: the agent publishes this marker and waits for it to come back.
pub const SYNC_TOPIC: &str = "/egress-agent/sync";

/// One event of interest, decoded from containerd's envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `/containers/create`: a sandbox's record exists before runc makes its cgroup.
    ContainerCreate(String),
    ContainerDelete(String),
    /// `/tasks/create` (container id): runc made the process, which has run nothing yet.
    TaskCreate(String),
    /// `/tasks/start`: its cgroup now exists, and its process runs as `pid`.
    TaskStart {
        id: String,
        pid: u32,
    },
    /// `/tasks/exit` of a container's init process (not of an exec in it).
    TaskExit(String),
    /// The agent's own marker ([`SYNC_TOPIC`]): the subscription is live from here on.
    Sync(String),
    /// Anything else (or a payload this code can't decode): ignored.
    Other,
}

/// A containerd connection scoped to one namespace (`k8s.io`).
#[derive(Clone)]
pub struct Client {
    channel: Channel,
    namespace: String,
}

impl Client {
    pub async fn connect(socket: &Path, namespace: &str) -> Result<Client, ClientError> {
        let channel =
            containerd_client::connect(socket)
                .await
                .map_err(|source| ClientError::Connect {
                    path: socket.to_owned(),
                    source,
                })?;
        Ok(Client {
            channel,
            namespace: namespace.to_owned(),
        })
    }

    fn request<T>(&self, msg: T) -> Request<T> {
        let mut req = Request::new(msg);
        if let Ok(ns) = self.namespace.parse() {
            req.metadata_mut().insert("containerd-namespace", ns);
        }
        req
    }

    /// Container and task events of the namespace, from now on.
    pub async fn subscribe(
        &self,
    ) -> Result<Streaming<containerd_client::types::Envelope>, ClientError> {
        let filters = vec![
            format!("namespace=={},topic~=\"^/containers/\"", self.namespace),
            format!("namespace=={},topic==\"/tasks/create\"", self.namespace),
            format!("namespace=={},topic==\"/tasks/start\"", self.namespace),
            format!("namespace=={},topic==\"/tasks/exit\"", self.namespace),
            format!("namespace=={},topic==\"{SYNC_TOPIC}\"", self.namespace),
        ];
        EventsClient::new(self.channel.clone())
            .subscribe(SubscribeRequest { filters })
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| ClientError::Call {
                call: "Events.Subscribe",
                status,
            })
    }

    /// Publish the marker `token` on [`SYNC_TOPIC`] in the namespace.
    pub async fn publish_sync(&self, token: &str) -> Result<(), ClientError> {
        use containerd_client::services::v1::PublishRequest;
        let req = self.request(PublishRequest {
            topic: SYNC_TOPIC.to_owned(),
            event: Some(prost_types_any(token)),
        });
        EventsClient::new(self.channel.clone())
            .publish(req)
            .await
            .map(drop)
            .map_err(|status| ClientError::Call {
                call: "Events.Publish",
                status,
            })
    }

    pub async fn list(&self) -> Result<Vec<Container>, ClientError> {
        let req = self.request(ListContainersRequest { filters: vec![] });
        ContainersClient::new(self.channel.clone())
            .list(req)
            .await
            .map(|r| r.into_inner().containers)
            .map_err(|status| ClientError::Call {
                call: "Containers.List",
                status,
            })
    }

    /// SIGKILL every process of a container's task (a container of a pod that can't be
    /// confined). A task that is gone already is fine.
    pub async fn kill(&self, id: &str) -> Result<(), ClientError> {
        use containerd_client::services::v1::{KillRequest, tasks_client::TasksClient};
        let req = self.request(KillRequest {
            container_id: id.to_owned(),
            exec_id: String::new(),
            signal: 9,
            all: true,
        });
        match TasksClient::new(self.channel.clone()).kill(req).await {
            Ok(_) => Ok(()),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(()),
            Err(status) => Err(ClientError::Call {
                call: "Tasks.Kill",
                status,
            }),
        }
    }

    /// The pid of a container's running task; `None` when it has no task or it is not running.
    pub async fn running_pid(&self, id: &str) -> Result<Option<u32>, ClientError> {
        use containerd_client::services::v1::{GetRequest, tasks_client::TasksClient};
        use containerd_client::types::v1::Status;
        let req = self.request(GetRequest {
            container_id: id.to_owned(),
            exec_id: String::new(),
        });
        match TasksClient::new(self.channel.clone()).get(req).await {
            Ok(r) => Ok(r
                .into_inner()
                .process
                .filter(|p| p.status == Status::Running as i32 && p.pid != 0)
                .map(|p| p.pid)),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(ClientError::Call {
                call: "Tasks.Get",
                status,
            }),
        }
    }

    /// A container's record; `None` when it is gone already.
    pub async fn get(&self, id: &str) -> Result<Option<Container>, ClientError> {
        let req = self.request(GetContainerRequest { id: id.to_owned() });
        match ContainersClient::new(self.channel.clone()).get(req).await {
            Ok(r) => Ok(r.into_inner().container),
            Err(status) if status.code() == tonic::Code::NotFound => Ok(None),
            Err(status) => Err(ClientError::Call {
                call: "Containers.Get",
                status,
            }),
        }
    }
}

/// The marker's payload: containerd relays an `Any` verbatim.
fn prost_types_any(token: &str) -> prost_types::Any {
    prost_types::Any {
        type_url: "egress-agent/sync".to_owned(),
        value: token.as_bytes().to_vec(),
    }
}

/// The labels and OCI spec bytes of a record.
pub fn parts(c: &Container) -> (&HashMap<String, String>, &[u8]) {
    (&c.labels, c.spec.as_ref().map_or(&[][..], |s| &s.value[..]))
}

/// Decode an envelope's payload by its topic. The payloads are containerd's event messages;
/// only their id fields are read.
pub fn decode(topic: &str, payload: Option<&[u8]>) -> Event {
    use containerd_client::events::{
        ContainerCreate, ContainerDelete, TaskCreate, TaskExit, TaskStart,
    };
    use prost::Message as _;
    let Some(bytes) = payload else {
        return Event::Other;
    };
    match topic {
        "/containers/create" => ContainerCreate::decode(bytes)
            .map(|e| Event::ContainerCreate(e.id))
            .unwrap_or(Event::Other),
        "/containers/delete" => ContainerDelete::decode(bytes)
            .map(|e| Event::ContainerDelete(e.id))
            .unwrap_or(Event::Other),
        "/tasks/create" => TaskCreate::decode(bytes)
            .map(|e| Event::TaskCreate(e.container_id))
            .unwrap_or(Event::Other),
        "/tasks/start" => TaskStart::decode(bytes)
            .map(|e| Event::TaskStart {
                id: e.container_id,
                pid: e.pid,
            })
            .unwrap_or(Event::Other),
        // An exec's exit names the exec's id; the init process's names the container.
        "/tasks/exit" => TaskExit::decode(bytes)
            .ok()
            .filter(|e| e.id == e.container_id)
            .map_or(Event::Other, |e| Event::TaskExit(e.container_id)),
        SYNC_TOPIC => Event::Sync(String::from_utf8_lossy(bytes).into_owned()),
        _ => Event::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn payloads_decode_by_topic() {
        use containerd_client::events::{ContainerCreate, TaskStart};
        let create = ContainerCreate {
            id: "abc".to_owned(),
            ..Default::default()
        }
        .encode_to_vec();
        assert_eq!(
            decode("/containers/create", Some(&create)),
            Event::ContainerCreate("abc".to_owned())
        );
        let start = TaskStart {
            container_id: "abc".to_owned(),
            pid: 7,
        }
        .encode_to_vec();
        assert_eq!(
            decode("/tasks/start", Some(&start)),
            Event::TaskStart {
                id: "abc".to_owned(),
                pid: 7
            }
        );
        let exit = |id: &str| {
            containerd_client::events::TaskExit {
                container_id: "abc".to_owned(),
                id: id.to_owned(),
                pid: 7,
                ..Default::default()
            }
            .encode_to_vec()
        };
        assert_eq!(
            decode("/tasks/exit", Some(&exit("abc"))),
            Event::TaskExit("abc".to_owned())
        );
        assert_eq!(
            decode("/tasks/exit", Some(&exit("exec-1"))),
            Event::Other,
            "an exec's exit is not the container's"
        );
        assert_eq!(decode("/tasks/exit", Some(&start)), Event::Other);
        assert_eq!(decode("/containers/create", None), Event::Other);
        assert_eq!(
            decode("/containers/create", Some(&[0xff, 0xff])),
            Event::Other
        );
    }
}
