//! reactor
