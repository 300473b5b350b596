package plugins

import fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"

// Register adds kvtier's plugin types to the EPP's registry; call it before
// the runner loads the EndpointPickerConfig.
func Register() {
	fwkplugin.Register(AffinityScorerType, AffinityScorerFactory)
	fwkplugin.Register(VersionScreenerType, VersionScreenerFactory)
	fwkplugin.Register(CacheSaltType, CacheSaltFactory)
}
