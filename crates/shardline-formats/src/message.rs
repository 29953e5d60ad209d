//! An error and its causes as one line, the way every front end (the CLI, the Python module)
//! reports it. Errors here name their cause in their own text (`#[error("…: {source}")]`) and
//! also return it as `source()`, so printing the chain naively says each cause twice; a cause
//! whose text is already in the line is left out.

use std::error::Error;

/// `error: cause: cause's cause`, each text once.
pub fn error_message(error: &(dyn Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut next = error.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        next = cause.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt;

    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);
    impl fmt::Display for E {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }
    impl Error for E {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn a_cause_already_in_the_text_is_said_once() {
        let e = E(
            "reading x",
            Some(Box::new(E(
                "x/.metadata: bad pickle: opcode 0x6e",
                Some(Box::new(E("bad pickle: opcode 0x6e", None))),
            ))),
        );
        assert_eq!(error_message(&e), "reading x: x/.metadata: bad pickle: opcode 0x6e");
        let e = E("writing y", Some(Box::new(E("disk full", None))));
        assert_eq!(error_message(&e), "writing y: disk full");
    }
}
