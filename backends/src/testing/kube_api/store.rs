//! The state of the in-process API server: Pods, their history, and the open watches.
//!
//! Every mutation takes the next `resourceVersion` (one counter for the whole store, as etcd's
//! revision), is appended to the history and fanned out to the matching watches while the store
//! lock is held, so each watch sees changes in version order. A watch filtered by a label selector
//! sees an object that starts matching as ADDED and one that stops matching as DELETED, as the
//! real watch cache does. History older than the compaction point cannot be replayed: a watch
//! from there gets a 410 Expired ERROR event.

use super::selector::Selector;
use axum::body::Bytes;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use tokio::sync::mpsc;

/// Capacity of one watch's queue; a watch that falls further behind is closed, as the API server
/// does with slow watchers.
const WATCH_QUEUE: usize = 4096;

/// What one watch body is fed with; an `Err` aborts the connection mid-stream.
pub(super) type Chunk = Result<Bytes, std::io::Error>;

/// One change of one Pod.
#[derive(Debug, Clone)]
struct Change {
    revision: u64,
    namespace: String,
    before: Option<Value>,
    after: Value,
    deleted: bool,
}

#[derive(Debug)]
struct OpenWatch {
    namespace: Option<String>,
    selector: Selector,
    bookmarks: bool,
    tx: mpsc::Sender<Chunk>,
}

impl OpenWatch {
    fn sees(&self, namespace: &str, object: &Value) -> bool {
        self.namespace.as_deref().is_none_or(|ns| ns == namespace) && self.selector.matches(object)
    }

    /// The event this watch gets for `change`, if any.
    fn event_for(&self, change: &Change) -> Option<Bytes> {
        if self
            .namespace
            .as_deref()
            .is_some_and(|ns| ns != change.namespace)
        {
            return None;
        }
        let before = change
            .before
            .as_ref()
            .is_some_and(|b| self.selector.matches(b));
        let after = self.selector.matches(&change.after);
        let kind = match (before, after, change.deleted) {
            (true, _, true) | (false, true, true) => "DELETED",
            (false, true, false) => "ADDED",
            (true, true, false) => "MODIFIED",
            (true, false, false) => "DELETED",
            (false, false, _) => return None,
        };
        Some(event_line(kind, &change.after))
    }
}

/// One watch event as a JSON line.
pub(super) fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

/// The `Status` object of an API error.
pub(super) fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// How a watch starts: events to send first, and the queue of live ones (`None`: end after the
/// first events).
pub(super) struct WatchStart {
    pub(super) initial: Vec<Bytes>,
    pub(super) live: Option<mpsc::Receiver<Chunk>>,
}

#[derive(Debug, Default)]
pub(super) struct Store {
    revision: u64,
    uid: u64,
    pods: BTreeMap<(String, String), Value>,
    history: Vec<Change>,
    /// Oldest version a watch may resume from.
    compacted: u64,
    watches: Vec<OpenWatch>,
    /// Refused requests, as `<resource>/<verb>`.
    pub(super) denied: HashSet<String>,
    /// Objects of custom resources by (`<group>/<version>`, plural, namespace, name); served
    /// for get and patch, not watched.
    custom: BTreeMap<CustomKey, Value>,
}

/// Where a custom object is stored: (`<group>/<version>`, plural, namespace, name).
pub(super) type CustomKey = (String, String, String, String);

impl Store {
    pub(super) fn revision(&self) -> u64 {
        self.revision
    }

    pub(super) fn custom(&self, key: &CustomKey) -> Option<&Value> {
        self.custom.get(key)
    }

    /// Stores a custom object with the next `resourceVersion`; returns it as stored.
    pub(super) fn put_custom(&mut self, key: CustomKey, mut object: Value) -> Value {
        self.revision += 1;
        object["metadata"]["resourceVersion"] = json!(self.revision.to_string());
        self.custom.insert(key, object.clone());
        object
    }

    pub(super) fn pod(&self, namespace: &str, name: &str) -> Option<&Value> {
        self.pods.get(&(namespace.to_owned(), name.to_owned()))
    }

    /// The matching Pods (items without `kind`/`apiVersion`, as in a real `PodList`).
    pub(super) fn list(&self, namespace: Option<&str>, selector: &Selector) -> Value {
        let items: Vec<Value> = self
            .pods
            .iter()
            .filter(|((ns, _), pod)| namespace.is_none_or(|n| n == ns) && selector.matches(pod))
            .map(|(_, pod)| {
                let mut item = pod.clone();
                if let Some(object) = item.as_object_mut() {
                    object.remove("kind");
                    object.remove("apiVersion");
                }
                item
            })
            .collect();
        json!({
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": self.revision.to_string()},
            "items": items,
        })
    }

    /// Creates a Pod (replacing none); returns it as stored.
    pub(super) fn create(&mut self, namespace: &str, mut pod: Value) -> Result<Value, Value> {
        let name = pod
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| {
                status(
                    422,
                    "Invalid",
                    "Pod \"\" is invalid: metadata.name: Required value",
                )
            })?;
        let key = (namespace.to_owned(), name.clone());
        if self.pods.contains_key(&key) {
            return Err(status(
                409,
                "AlreadyExists",
                &format!("pods {name:?} already exists"),
            ));
        }
        self.uid += 1;
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        pod["metadata"]["namespace"] = json!(namespace);
        pod["metadata"]["uid"] = json!(format!("00000000-0000-4000-8000-{:012x}", self.uid));
        if pod.pointer("/metadata/creationTimestamp").is_none() {
            pod["metadata"]["creationTimestamp"] = json!(super::now_rfc3339());
        }
        Ok(self.commit(key, None, pod, false))
    }

    /// Replaces a Pod by `f` applied to a copy; no version bump if nothing changed. `None` if the
    /// Pod does not exist.
    pub(super) fn modify(
        &mut self,
        namespace: &str,
        name: &str,
        f: impl FnOnce(&mut Value),
    ) -> Option<Value> {
        let key = (namespace.to_owned(), name.to_owned());
        let before = self.pods.get(&key)?.clone();
        let mut after = before.clone();
        f(&mut after);
        // Identity fields are the server's.
        for field in [
            "name",
            "namespace",
            "uid",
            "resourceVersion",
            "creationTimestamp",
        ] {
            after["metadata"][field] = before["metadata"][field].clone();
        }
        if after == before {
            return Some(before);
        }
        Some(self.commit(key, Some(before), after, false))
    }

    /// Deletes a Pod; returns its final state.
    pub(super) fn delete(&mut self, namespace: &str, name: &str) -> Option<Value> {
        let key = (namespace.to_owned(), name.to_owned());
        let before = self.pods.get(&key)?.clone();
        let after = before.clone();
        Some(self.commit(key, Some(before), after, true))
    }

    fn commit(
        &mut self,
        key: (String, String),
        before: Option<Value>,
        mut after: Value,
        deleted: bool,
    ) -> Value {
        self.revision += 1;
        after["metadata"]["resourceVersion"] = json!(self.revision.to_string());
        if deleted {
            self.pods.remove(&key);
        } else {
            self.pods.insert(key.clone(), after.clone());
        }
        let change = Change {
            revision: self.revision,
            namespace: key.0,
            before,
            after: after.clone(),
            deleted,
        };
        self.watches.retain(|watch| match watch.event_for(&change) {
            Some(line) => watch.tx.try_send(Ok(line)).is_ok(),
            None => !watch.tx.is_closed(),
        });
        self.history.push(change);
        after
    }

    /// Opens a watch from `version` (`None`, `""` or `"0"`: the current state as ADDED events).
    pub(super) fn watch(
        &mut self,
        namespace: Option<&str>,
        selector: Selector,
        version: Option<&str>,
        bookmarks: bool,
    ) -> Result<WatchStart, Value> {
        let watch_ns = namespace.map(str::to_owned);
        let from = match version.filter(|v| !v.is_empty() && *v != "0") {
            None => None,
            Some(v) => Some(v.parse::<u64>().map_err(|_| {
                status(
                    400,
                    "BadRequest",
                    &format!("invalid resource version {v:?}"),
                )
            })?),
        };
        let (tx, rx) = mpsc::channel(WATCH_QUEUE);
        let watch = OpenWatch {
            namespace: watch_ns,
            selector,
            bookmarks,
            tx,
        };
        let initial = match from {
            None => self
                .pods
                .iter()
                .filter(|((ns, _), pod)| watch.sees(ns, pod))
                .map(|(_, pod)| event_line("ADDED", pod))
                .collect(),
            Some(from) if from < self.compacted => {
                let expired = status(
                    410,
                    "Expired",
                    &format!("too old resource version: {from} ({})", self.compacted),
                );
                return Ok(WatchStart {
                    initial: vec![event_line("ERROR", &expired)],
                    live: None,
                });
            }
            Some(from) => self
                .history
                .iter()
                .filter(|change| change.revision > from)
                .filter_map(|change| watch.event_for(change))
                .collect(),
        };
        self.watches.push(watch);
        Ok(WatchStart {
            initial,
            live: Some(rx),
        })
    }

    /// Forgets the history: watches from any version before the current one get 410.
    pub(super) fn compact(&mut self) {
        self.compacted = self.revision;
        self.history.clear();
    }

    /// Sends a BOOKMARK at the current version to every watch that asked for bookmarks.
    pub(super) fn bookmark(&mut self) {
        let object = json!({
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": self.revision.to_string()},
        });
        let line = event_line("BOOKMARK", &object);
        self.watches
            .retain(|watch| !watch.bookmarks || watch.tx.try_send(Ok(line.clone())).is_ok());
    }

    /// Ends every watch: cleanly (`abort == false`, as at `timeoutSeconds`) or by breaking the
    /// connection mid-stream.
    pub(super) fn end_watches(&mut self, abort: bool) -> usize {
        let watches = std::mem::take(&mut self.watches);
        let count = watches.len();
        if abort {
            for watch in watches {
                let broken = std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "watch connection dropped by the test",
                );
                let _ = watch.tx.try_send(Err(broken));
            }
        }
        count
    }

    /// Number of watches still connected.
    pub(super) fn open_watches(&mut self) -> usize {
        self.watches.retain(|watch| !watch.tx.is_closed());
        self.watches.len()
    }
}

/// JSON merge patch (RFC 7386) of `patch` into `target`.
pub(super) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(fields) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Value::Object(object) = target {
        for (key, value) in fields {
            if value.is_null() {
                object.remove(key);
            } else {
                merge_patch(object.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

/// Whether a strategic merge patch uses directives this server does not implement.
pub(super) fn strategic_directive(patch: &Value) -> Option<String> {
    match patch {
        Value::Object(fields) => fields.iter().find_map(|(key, value)| {
            if key.starts_with('$') {
                Some(key.clone())
            } else {
                strategic_directive(value)
            }
        }),
        Value::Array(items) => items.iter().find_map(strategic_directive),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_sets_replaces_and_removes() {
        let mut pod =
            json!({"metadata": {"annotations": {"a": "1", "b": "2"}, "labels": {"x": "y"}}});
        merge_patch(
            &mut pod,
            &json!({"metadata": {"annotations": {"a": null, "c": "3"}}}),
        );
        assert_eq!(
            pod,
            json!({"metadata": {"annotations": {"b": "2", "c": "3"}, "labels": {"x": "y"}}})
        );
    }

    #[test]
    fn a_selector_watch_sees_objects_entering_and_leaving_it() {
        let mut store = Store::default();
        let selector = Selector::parse("app=w").unwrap();
        let mut start = store.watch(Some("ns"), selector, None, false).unwrap();
        let mut rx = start.live.take().unwrap();
        store
            .create(
                "ns",
                json!({"metadata": {"name": "p", "labels": {"app": "other"}}}),
            )
            .unwrap();
        store.modify("ns", "p", |p| p["metadata"]["labels"]["app"] = json!("w"));
        store.modify("ns", "p", |p| {
            p["metadata"]["labels"]["app"] = json!("other")
        });
        let kinds: Vec<String> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|chunk| {
                let line: Value = serde_json::from_slice(&chunk.unwrap()).unwrap();
                line["type"].as_str().unwrap().to_owned()
            })
            .collect();
        assert_eq!(kinds, ["ADDED", "DELETED"]);
    }

    #[test]
    fn a_watch_from_a_compacted_version_gets_410() {
        let mut store = Store::default();
        store
            .create("ns", json!({"metadata": {"name": "p"}}))
            .unwrap();
        store
            .create("ns", json!({"metadata": {"name": "q"}}))
            .unwrap();
        let replay = store
            .watch(Some("ns"), Selector::default(), Some("0"), false)
            .unwrap();
        assert_eq!(replay.initial.len(), 2);
        store.compact();
        let current = store
            .watch(Some("ns"), Selector::default(), Some("2"), false)
            .unwrap();
        assert!(
            current.initial.is_empty() && current.live.is_some(),
            "nothing to replay"
        );
        let expired = store
            .watch(Some("ns"), Selector::default(), Some("1"), false)
            .unwrap();
        assert!(expired.live.is_none());
        let line: Value = serde_json::from_slice(&expired.initial[0]).unwrap();
        assert_eq!(line["type"], "ERROR");
        assert_eq!(line["object"]["code"], 410);
    }
}
