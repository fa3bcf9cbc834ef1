//! Projections: state computed by folding the event log.
//!
//! A projection is written only by [`Projection::apply`], in log order. [`Projection::dump`] returns
//! events that, applied to an empty projection, rebuild the same state exactly — which is what a
//! log snapshot stores.

use crate::event::{Envelope, Event};

pub trait Projection {
    /// Folds one event into the state. Events that do not concern this projection are ignored.
    fn apply(&mut self, env: &Envelope);

    /// The state as a list of events that rebuilds it.
    fn dump(&self) -> Vec<Event>;
}
