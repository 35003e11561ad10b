//! conn
