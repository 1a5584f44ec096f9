//! What a certificate says, for identities and for messages: subject, issuer, validity.

use std::fmt;

use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::time::ASN1Time;

/// The facts of a certificate a refusal names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertSummary {
    /// `CN=alice, O=lunakv`.
    pub subject: String,
    pub issuer: String,
    pub not_before: String,
    pub not_after: String,
    /// Past `not_after` now.
    pub expired: bool,
    /// Before `not_before` now.
    pub not_yet_valid: bool,
    /// [`identity_of`].
    pub identity: Option<String>,
}

impl CertSummary {
    /// `None` when `der` is not an X.509 certificate.
    pub fn of(der: &[u8]) -> Option<CertSummary> {
        let (_, c) = X509Certificate::from_der(der).ok()?;
        let v = c.validity();
        let now = ASN1Time::now();
        Some(CertSummary {
            subject: name_or_empty(&c.subject().to_string()),
            issuer: name_or_empty(&c.issuer().to_string()),
            not_before: v.not_before.to_string(),
            not_after: v.not_after.to_string(),
            expired: v.not_after < now,
            not_yet_valid: v.not_before > now,
            identity: identity(&c),
        })
    }
}

fn name_or_empty(s: &str) -> String {
    if s.is_empty() {
        "(empty subject)".to_string()
    } else {
        s.to_string()
    }
}

impl fmt::Display for CertSummary {
    /// `subject CN=alice, issued by CN=lunakv CA, valid Jan 1 .. Jan 1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "subject {}, issued by {}, valid {} .. {}",
            self.subject, self.issuer, self.not_before, self.not_after
        )?;
        if self.expired {
            f.write_str(", EXPIRED")?;
        } else if self.not_yet_valid {
            f.write_str(", NOT YET VALID")?;
        }
        Ok(())
    }
}

/// The identity a client certificate proves: its subject's CN, else its first SAN (a DNS name,
/// URI, e-mail address or IP address, as cert-manager issues them without a CN). `None` for a
/// certificate with neither, or that does not parse.
pub fn identity_of(der: &[u8]) -> Option<String> {
    let (_, c) = X509Certificate::from_der(der).ok()?;
    identity(&c)
}

fn identity(c: &X509Certificate<'_>) -> Option<String> {
    if let Some(cn) = c
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        return Some(cn.to_string());
    }
    let san = c.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|g| match g {
        GeneralName::DNSName(s) | GeneralName::URI(s) | GeneralName::RFC822Name(s) => {
            Some((*s).to_string())
        }
        GeneralName::IPAddress(b) => match b.len() {
            4 => Some(std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).ok()?).to_string()),
            16 => Some(std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).ok()?).to_string()),
            _ => None,
        },
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(cn: Option<&str>, sans: Vec<String>, expired: bool) -> Vec<u8> {
        let mut p = rcgen::CertificateParams::new(sans).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        if let Some(cn) = cn {
            p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        }
        if expired {
            p.not_before = rcgen::date_time_ymd(2020, 1, 1);
            p.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let k = rcgen::KeyPair::generate().unwrap();
        p.self_signed(&k).unwrap().der().to_vec()
    }

    #[test]
    fn the_identity_is_the_cn_else_the_first_san() {
        let c = cert(Some("alice"), vec!["alice.lunakv".into()], false);
        assert_eq!(identity_of(&c).as_deref(), Some("alice"));
        let c = cert(None, vec!["store.lunakv.svc".into(), "x".into()], false);
        assert_eq!(identity_of(&c).as_deref(), Some("store.lunakv.svc"));
        let s = CertSummary::of(&c).unwrap();
        assert!(!s.expired && s.subject.contains("empty"), "{s}");
        let c = cert(Some("old"), vec![], true);
        let s = CertSummary::of(&c).unwrap();
        assert!(
            s.expired && s.to_string().contains("EXPIRED") && s.subject == "CN=old",
            "{s}"
        );
        assert!(identity_of(b"not a certificate").is_none());
    }
}
