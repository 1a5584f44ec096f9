//! Declaring a service's keys once: [`key_table!`](crate::key_table!) turns one table (name,
//! type, default, help, extra clap settings such as upstream's alias) into the config struct,
//! its `Default`, the clap struct of `Option`s that is the flag layer, and the list of keys, so
//! a default is written in one place and the `--help` text shows it from there.

use std::path::PathBuf;

use clap::builder::{Resettable, ValueRange};

/// How `--help` shows a key's default after its help text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shown {
    /// `[default: <value>]`.
    Value,
    /// `[default: <value><note>]`: the value and a remark (`; upstream binds 0.0.0.0`).
    Note(&'static str),
    /// `[default: <text>]`, for an empty default that means "fall back to" something else
    /// (`rpc_address`); the table's test holds such defaults empty.
    Text(&'static str),
    /// No default shown.
    Hidden,
}

/// One key of a service's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    /// The key: the config field, the file key, the flag (`--<name>`) and the variable suffix.
    pub name: &'static str,
    /// The `--help` line without its default. `{default}` marks where the default goes when
    /// it is not at the end.
    pub help: &'static str,
    pub shown: Shown,
}

impl Key {
    /// The `--help` line with the default, given the default as text.
    pub fn help_with(&self, default: &str) -> String {
        let bracket = match self.shown {
            Shown::Value => format!("[default: {default}]"),
            Shown::Note(note) => format!("[default: {default}{note}]"),
            Shown::Text(text) => format!("[default: {text}]"),
            Shown::Hidden => return self.help.to_string(),
        };
        if self.help.contains("{default}") {
            self.help.replace("{default}", &bracket)
        } else {
            format!("{} {bracket}", self.help)
        }
    }
}

/// What the table needs of a key's type: its default as `--help` shows it, and how its flag
/// takes a value (a boolean is gflags' `--flag` or `--flag=false`; others take one value).
pub trait KeyType {
    /// The value as `--help` and validation messages show it.
    fn show(&self) -> String;
    /// `num_args` of the flag; `Reset` keeps clap's one value.
    fn num_args() -> Resettable<ValueRange> {
        Resettable::Reset
    }
    /// Whether the flag's value must follow `=` (so `--flag next` is not read as its value).
    const REQUIRE_EQUALS: bool = false;
    /// The value of the flag given bare.
    const MISSING: Option<&'static str> = None;
}

macro_rules! shown_by_display {
    ($($t:ty),*) => {$(
        impl KeyType for $t {
            fn show(&self) -> String {
                self.to_string()
            }
        }
    )*};
}
shown_by_display!(u16, u32, u64, f64, String);

impl KeyType for PathBuf {
    fn show(&self) -> String {
        self.display().to_string()
    }
}

impl KeyType for bool {
    fn show(&self) -> String {
        self.to_string()
    }
    fn num_args() -> Resettable<ValueRange> {
        Resettable::Value((0..=1).into())
    }
    const REQUIRE_EQUALS: bool = true;
    const MISSING: Option<&'static str> = Some("true");
}

/// Declares a service's keys once. For each key:
/// ```text
/// /// Field docs (rustdoc of the config struct).
/// name: Type = default_expression => "help line", [shown Shown::Note("..."),] [arg(alias = "x"),];
/// ```
/// generates the config struct (one field per key, in table order: that order is the keys'
/// order in messages and `--help`), its `Default`, the clap struct (an `Option` per key, flag
/// `--name`, help from [`Key::help_with`] and the default), `KEYS` (the [`Key`]s) and
/// `default_text(key)`. The clap struct's own fields (`--config`) come first, written out.
#[macro_export]
macro_rules! key_table {
    (
        $(#[$cmeta:meta])*
        pub struct $Config:ident;
        $(#[$ameta:meta])*
        pub struct $Args:ident { $($own:tt)* }
        pub const $KEYS:ident;
        $(
            $(#[$fmeta:meta])*
            $name:ident : $ty:ty = $default:expr => $help:literal
                $(, shown $shown:expr)? $(, arg($($arg:tt)*))? $(,)?;
        )*
    ) => {
        $(#[$cmeta])*
        pub struct $Config {
            $( $(#[$fmeta])* pub $name: $ty, )*
        }

        impl Default for $Config {
            fn default() -> Self {
                $Config { $( $name: $default, )* }
            }
        }

        $(#[$ameta])*
        pub struct $Args {
            $($own)*
            $(
                #[arg(
                    long = stringify!($name),
                    help = $Config::key_help(stringify!($name)),
                    num_args = <$ty as $crate::key_table::KeyType>::num_args(),
                    require_equals = <$ty as $crate::key_table::KeyType>::REQUIRE_EQUALS,
                    default_missing_value = <$ty as $crate::key_table::KeyType>::MISSING
                    $(, $($arg)*)?
                )]
                pub $name: Option<$ty>,
            )*
        }

        /// Every key, in table order, with its help.
        pub const $KEYS: &[$crate::key_table::Key] = &[
            $(
                $crate::key_table::Key {
                    name: stringify!($name),
                    help: $help,
                    shown: $crate::key_table!(@shown $($shown)?),
                },
            )*
        ];

        impl $Config {
            /// The default of `key` as `--help` and messages show it (`None`: no such key).
            pub fn default_text(key: &str) -> Option<String> {
                let d = Self::default();
                match key {
                    $( stringify!($name) => Some($crate::key_table::KeyType::show(&d.$name)), )*
                    _ => None,
                }
            }

            /// The `--help` line of `key`, its default included.
            pub fn key_help(key: &str) -> String {
                let default = Self::default_text(key).unwrap_or_default();
                $KEYS
                    .iter()
                    .find(|k| k.name == key)
                    .map(|k| k.help_with(&default))
                    .unwrap_or_default()
            }
        }
    };
    (@shown) => { $crate::key_table::Shown::Value };
    (@shown $shown:expr) => { $shown };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_goes_at_the_end_or_where_marked() {
        let key = |help, shown| Key {
            name: "k",
            help,
            shown,
        };
        assert_eq!(
            key("Port", Shown::Value).help_with("7"),
            "Port [default: 7]"
        );
        assert_eq!(
            key("Bind", Shown::Note("; upstream 0.0.0.0")).help_with("127.0.0.1"),
            "Bind [default: 127.0.0.1; upstream 0.0.0.0]"
        );
        assert_eq!(
            key("Host", Shown::Text("rpc_address")).help_with(""),
            "Host [default: rpc_address]"
        );
        assert_eq!(key("On", Shown::Hidden).help_with("false"), "On");
        assert_eq!(
            key("On {default}. More", Shown::Value).help_with("false"),
            "On [default: false]. More"
        );
    }
}
