//! A token that does not print.

use std::fmt;

/// A Hub access token. `Debug` prints `Secret(<redacted>)`; there is no `Display`.
/// The only way to the value is [`Secret::expose`], which this crate calls in one place:
/// building the `Authorization` header (itself marked sensitive).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a token. Surrounding whitespace (a trailing newline from a token file) is dropped.
    pub fn new(token: impl Into<String>) -> Self {
        let token: String = token.into();
        Secret(token.trim().to_owned())
    }

    /// The token itself. Do not log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// True if the token is empty (an empty `HF_TOKEN` means "no token").
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret::new(s)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret::new(s)
    }
}
