/*
 * Prints the size, alignment and every member's offset and size of the NCCL
 * plugin structs (v8 ... v12) as a C compiler lays them out.
 * tests/abi_layout.rs compiles this at test time and compares every line with
 * size_of/align_of/offset_of! of railover::ffi::types and with the numbers it
 * holds from NCCL's headers (docs/design.md §8.1).
 *
 * Output, one record per line:
 *   struct <c type> <sizeof> <alignof>
 *   field <c type> <member> <offsetof> <sizeof member>
 */
#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>

#include "nccl_net.h"

#define S(T) printf("struct %s %zu %zu\n", #T, sizeof(T), alignof(T))
#define F(T, m) printf("field %s %s %zu %zu\n", #T, #m, offsetof(T, m), sizeof(((T*)0)->m))

/* v8 ... v12 are typedefs of ncclNetDeviceHandle_v7_t; print each anyway. */
#define DEVICE_HANDLE(T)       \
  S(T);                        \
  F(T, netDeviceType);         \
  F(T, netDeviceVersion);      \
  F(T, handle);                \
  F(T, size);                  \
  F(T, needsProxyProgress)

static void device_handles(void) {
  DEVICE_HANDLE(ncclNetDeviceHandle_v8_t);
  DEVICE_HANDLE(ncclNetDeviceHandle_v9_t);
  DEVICE_HANDLE(ncclNetDeviceHandle_v10_t);
  DEVICE_HANDLE(ncclNetDeviceHandle_v11_t);
  DEVICE_HANDLE(ncclNetDeviceHandle_v12_t);
}

#define VPROPS(T) \
  S(T);           \
  F(T, ndevs);    \
  F(T, devs)

#define CONFIG(T) \
  S(T);           \
  F(T, trafficClass)

#define COMM_ATTR(T)         \
  S(T);                      \
  F(T, maxConcurrentPeers);  \
  F(T, minConcurrentPeers);  \
  F(T, maxFlowsPerPeer);     \
  F(T, minFlowsPerPeer)

#define NET_ATTR(T)    \
  S(T);                \
  F(T, sendCommAttr);  \
  F(T, recvCommAttr);  \
  F(T, op);            \
  F(T, algo);          \
  F(T, proto)

/* Members common to every properties version, up to maxRecvs/netDevice*. */
#define PROPS_HEAD(T)  \
  F(T, name);          \
  F(T, pciPath);       \
  F(T, guid);          \
  F(T, ptrSupport);    \
  F(T, regIsGlobal);   \
  F(T, speed);         \
  F(T, port);          \
  F(T, latency);       \
  F(T, maxComms);      \
  F(T, maxRecvs);      \
  F(T, netDeviceType); \
  F(T, netDeviceVersion)

#define PROPS_V9(T)   \
  PROPS_HEAD(T);      \
  F(T, forceFlush);   \
  F(T, vProps);       \
  F(T, maxP2pBytes);  \
  F(T, maxCollBytes)

static void properties(void) {
  S(ncclNetProperties_v8_t);
  PROPS_HEAD(ncclNetProperties_v8_t);

  S(ncclNetProperties_v9_t);
  PROPS_V9(ncclNetProperties_v9_t);

  S(ncclNetProperties_v10_t);
  PROPS_V9(ncclNetProperties_v10_t);

  S(ncclNetProperties_v11_t);
  PROPS_V9(ncclNetProperties_v11_t);
  F(ncclNetProperties_v11_t, maxMultiRequestSize);

  S(ncclNetProperties_v12_t);
  PROPS_V9(ncclNetProperties_v12_t);
  F(ncclNetProperties_v12_t, maxMultiRequestSize);
  F(ncclNetProperties_v12_t, railId);
  F(ncclNetProperties_v12_t, planeId);
}

/* The 19 members every function table from v8 on has. */
#define NET_V8(T)        \
  F(T, name);            \
  F(T, init);            \
  F(T, devices);         \
  F(T, getProperties);   \
  F(T, listen);          \
  F(T, connect);         \
  F(T, accept);          \
  F(T, regMr);           \
  F(T, regMrDmaBuf);     \
  F(T, deregMr);         \
  F(T, isend);           \
  F(T, irecv);           \
  F(T, iflush);          \
  F(T, test);            \
  F(T, closeSend);       \
  F(T, closeRecv);       \
  F(T, closeListen);     \
  F(T, getDeviceMr);     \
  F(T, irecvConsumed)

static void tables(void) {
  S(ncclNet_v8_t);
  NET_V8(ncclNet_v8_t);

  S(ncclNet_v9_t);
  NET_V8(ncclNet_v9_t);
  F(ncclNet_v9_t, makeVDevice);

  S(ncclNet_v10_t);
  NET_V8(ncclNet_v10_t);
  F(ncclNet_v10_t, makeVDevice);

  S(ncclNet_v11_t);
  NET_V8(ncclNet_v11_t);
  F(ncclNet_v11_t, makeVDevice);
  F(ncclNet_v11_t, finalize);
  F(ncclNet_v11_t, setNetAttr);

  S(ncclNet_v12_t);
  NET_V8(ncclNet_v12_t);
  F(ncclNet_v12_t, makeVDevice);
  F(ncclNet_v12_t, finalize);
  F(ncclNet_v12_t, setNetAttr);
}

int main(void) {
  device_handles();
  VPROPS(ncclNetVDeviceProps_v9_t);
  VPROPS(ncclNetVDeviceProps_v10_t);
  VPROPS(ncclNetVDeviceProps_v11_t);
  VPROPS(ncclNetVDeviceProps_v12_t);
  CONFIG(ncclNetCommConfig_v10_t);
  CONFIG(ncclNetCommConfig_v11_t);
  CONFIG(ncclNetCommConfig_v12_t);
  COMM_ATTR(ncclNetCommAttr_v11_t);
  COMM_ATTR(ncclNetCommAttr_v12_t);
  NET_ATTR(ncclNetAttr_v11_t);
  NET_ATTR(ncclNetAttr_v12_t);
  properties();
  tables();
  return fflush(stdout) == 0 ? 0 : 1;
}
