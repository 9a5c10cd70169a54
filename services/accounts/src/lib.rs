//! stemq-accounts: who a caller is and what they may spend.
//!
//! - [`auth`]: API keys, roles and their permissions, per-key limits, the `stemq_keys`
//!   bucket; who a caller is;
//! - [`ledger`]: the credits ledger (`STEMQ_LEDGER`): grants, reservations, settlements
//!   and refunds per owner, the prices, and an owner's account folded from its entries.
//!
//! Both live in NATS (through `stemq-nats`); the ingress answers callers with them, the
//! worker and the projector move credits, `stemq keys` and `stemq credits` administer them.

pub mod auth;
pub mod ledger;
