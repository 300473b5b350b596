module github.com/kvtier/kvtier/router

go 1.26

require github.com/cespare/xxhash/v2 v2.3.0
