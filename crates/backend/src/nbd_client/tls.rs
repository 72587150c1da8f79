//! TLS for `nbds://` and `nbds+unix://`, in userspace with rustls (ring provider): the kernels
//! fusex runs on need not have kTLS, so every byte is encrypted and decrypted in the daemon.
//!
//! The client settings are built once when the export is opened (the certificate files are read
//! then, before the privilege drop, and reconnects reuse them). Certificates follow libnbd's
//! `tls-certificates=DIR` layout: the CA in `DIR/ca-cert.pem`, and a client certificate and key in
//! `DIR/client-cert.pem` and `DIR/client-key.pem` if both exist. Without a directory the system's
//! CA bundle is used.

use std::fs::File;
use std::io::{self, BufReader};
use std::path::Path;
use std::sync::Arc;

use nbd::{NbdUri, Transport};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

/// The system's CA bundle (Debian's `ca-certificates`), used without `tls-certificates=`.
pub(crate) const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The server name sent (SNI) on a Unix socket without `tls-hostname=`; its certificate's names
/// are not checked then (there is no host name to check them against).
const UNIX_SNI: &str = "localhost";

/// How to make TLS sessions to one export's server.
#[derive(Clone, Debug)]
pub(crate) struct TlsClient {
    /// Roots, client certificate, verifier (shared by every connection to the export).
    pub(crate) config: Arc<ClientConfig>,
    /// The name the server's certificate must carry (and the SNI).
    pub(crate) name: ServerName<'static>,
}

/// Builds the TLS settings of `uri`, or `None` without TLS. Errors are one line naming the file
/// and what to do.
pub(crate) fn client(uri: &NbdUri) -> Result<Option<TlsClient>, String> {
    let Some(tls) = &uri.tls else {
        return Ok(None);
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup failed: {e}"))?;

    // The name to verify: tls-hostname=, else the URI's host; a Unix socket has none.
    let (name, check_name) = match (&tls.hostname, &uri.transport) {
        (Some(h), _) => (h.as_str(), true),
        (None, Transport::Tcp { host, .. }) => (host.as_str(), true),
        (None, Transport::Unix(_)) => (UNIX_SNI, false),
    };
    let name = ServerName::try_from(name.to_string())
        .map_err(|_| format!("{name:?} is not a valid TLS server name: set tls-hostname="))?;

    let verifier: Arc<dyn ServerCertVerifier> = if tls.verify_peer {
        let roots = roots(tls.certificates.as_deref())?;
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| format!("TLS setup failed: {e}"))?;
        Arc::new(Verifier {
            webpki,
            check_name,
            provider: provider.clone(),
        })
    } else {
        tracing::warn!(
            "NBD TLS: tls-verify-peer=false: the server's certificate is not checked; anyone \
             between fusex and the server can read and change the data"
        );
        Arc::new(NoVerifier(provider.clone()))
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);

    let config = match client_identity(tls.certificates.as_deref())? {
        Some((certs, key)) => builder
            .with_client_auth_cert(certs, key)
            .map_err(|e| format!("TLS client certificate not usable: {e}"))?,
        None => builder.with_no_client_auth(),
    };
    Ok(Some(TlsClient {
        config: Arc::new(config),
        name,
    }))
}

/// The trusted CAs: `DIR/ca-cert.pem`, or the system bundle.
fn roots(dir: Option<&Path>) -> Result<RootCertStore, String> {
    let (path, hint) = match dir {
        Some(d) => (
            d.join("ca-cert.pem"),
            "tls-certificates=DIR needs the CA that signed the server's certificate in DIR/ca-cert.pem",
        ),
        None => (
            SYSTEM_CA_BUNDLE.into(),
            "install ca-certificates, or give tls-certificates=DIR with DIR/ca-cert.pem",
        ),
    };
    let certs = read_certs(&path).map_err(|e| format!("{}: {e}: {hint}", path.display()))?;
    let mut store = RootCertStore::empty();
    let (added, _ignored) = store.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!(
            "{}: no usable CA certificate in it: {hint}",
            path.display()
        ));
    }
    Ok(store)
}

/// The client's certificate and key, when `DIR/client-cert.pem` and `DIR/client-key.pem` both
/// exist (servers that require client certificates need them; others ignore them).
#[allow(clippy::type_complexity)]
fn client_identity(
    dir: Option<&Path>,
) -> Result<Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>, String> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    let (cert, key) = (dir.join("client-cert.pem"), dir.join("client-key.pem"));
    match (cert.exists(), key.exists()) {
        (false, false) => return Ok(None),
        (true, false) | (false, true) => {
            return Err(format!(
                "{}: a client certificate needs both client-cert.pem and client-key.pem",
                dir.display()
            ))
        }
        (true, true) => {}
    }
    let certs = read_certs(&cert).map_err(|e| format!("{}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in it", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(&key)
        .map_err(|e| format!("{}: no usable private key: {e}", key.display()))?;
    Ok(Some((certs, key)))
}

fn read_certs(path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let f = BufReader::new(File::open(path)?);
    CertificateDer::pem_reader_iter(f)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
}

/// The standard verifier, except that without a name to check (a Unix socket without
/// `tls-hostname=`) a certificate for another name is accepted: its chain to the CA is still
/// checked, which is what libnbd does when it has no host name.
#[derive(Debug)]
struct Verifier {
    webpki: Arc<WebPkiServerVerifier>,
    check_name: bool,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// `tls-verify-peer=false`: any certificate is accepted (the handshake's signatures are still
/// checked against it, so the session is encrypted, just not authenticated).
#[derive(Debug)]
struct NoVerifier(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerifier {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// A failed TLS handshake as one line with what to do about it.
pub(crate) fn explain(e: &io::Error) -> String {
    let inner = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>());
    match inner {
        Some(rustls::Error::InvalidCertificate(
            c @ (CertificateError::NotValidForName
            | CertificateError::NotValidForNameContext { .. }),
        )) => format!(
            "the server's certificate was rejected: it is not for this host name ({c:?}): \
             connect by a name it carries, or set tls-hostname="
        ),
        Some(rustls::Error::InvalidCertificate(c)) => format!(
            "the server's certificate was rejected ({c:?}): give tls-certificates=DIR with the \
             CA that signed it in DIR/ca-cert.pem"
        ),
        Some(rustls::Error::AlertReceived(a)) => format!(
            "the server ended the TLS handshake ({a:?}): if it requires a client certificate, \
             put client-cert.pem and client-key.pem in the tls-certificates= directory"
        ),
        Some(r) => format!("TLS handshake failed: {r}"),
        None => format!("TLS handshake failed: {e}"),
    }
}

/// The NBD handshake failing right after the TLS handshake: with TLS 1.3 a server checks the
/// client's certificate only after the client considers the handshake done, so a missing or
/// rejected client certificate shows up as the server hanging up here.
pub(crate) fn explain_after_handshake(e: &io::Error) -> Option<String> {
    let hung_up = matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
    );
    let tls = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>());
    match tls {
        Some(rustls::Error::AlertReceived(a)) => Some(format!(
            "the server ended the TLS session ({a:?}): if it requires a client certificate, put \
             client-cert.pem and client-key.pem (signed by a CA it trusts) in the \
             tls-certificates= directory"
        )),
        _ if hung_up => Some(
            "the server hung up right after the TLS handshake: if it requires a client \
             certificate, put client-cert.pem and client-key.pem (signed by a CA it trusts) in \
             the tls-certificates= directory"
                .to_string(),
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(uri: &str) -> Result<Option<TlsClient>, String> {
        client(&NbdUri::parse(uri).unwrap())
    }

    #[test]
    fn plain_uris_have_no_tls() {
        assert!(settings("nbd://h/e").unwrap().is_none());
        assert!(settings("nbd+unix:///?socket=/s&tls-certificates=/x")
            .unwrap()
            .is_none());
    }

    #[test]
    fn server_names() {
        let t = settings("nbds+unix:///?socket=/s&tls-verify-peer=false")
            .unwrap()
            .unwrap();
        assert_eq!(t.name, ServerName::try_from("localhost").unwrap());
        let t = settings("nbds://10.1.2.3:99/?tls-verify-peer=false")
            .unwrap()
            .unwrap();
        assert!(matches!(t.name, ServerName::IpAddress(_)));
        let t = settings("nbds://10.1.2.3/?tls-verify-peer=false&tls-hostname=nbd.example")
            .unwrap()
            .unwrap();
        assert_eq!(t.name, ServerName::try_from("nbd.example").unwrap());
    }

    #[test]
    fn missing_files_are_named() {
        let e = settings("nbds://h/?tls-certificates=/nonexistent/pki").unwrap_err();
        assert!(e.contains("/nonexistent/pki/ca-cert.pem"), "{e}");
        assert!(e.contains("tls-certificates=DIR needs the CA"), "{e}");
        assert!(!e.contains('\n'));

        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca-cert.pem"), "not a certificate\n").unwrap();
        let u = format!("nbds://h/?tls-certificates={}", dir.path().display());
        let e = settings(&u).unwrap_err();
        assert!(e.contains("no usable CA certificate"), "{e}");

        // A client certificate without its key.
        std::fs::write(dir.path().join("client-cert.pem"), "x\n").unwrap();
        let u = format!(
            "nbds://h/?tls-certificates={}&tls-verify-peer=false",
            dir.path().display()
        );
        let e = settings(&u).unwrap_err();
        assert!(
            e.contains("needs both client-cert.pem and client-key.pem"),
            "{e}"
        );
    }
}
