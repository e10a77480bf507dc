"""Console pages by area: sign-in, dashboard, approvals, people, ownership, audit."""

from __future__ import annotations

from django.urls import URLPattern, URLResolver, path

from approvals.views import claims, inbox, plans, rules, runs, tokens
from audit import views as audit_views
from console import people_views, views
from ownership import catalog_views
from ownership import views as ownership_views

urlpatterns: list[URLPattern | URLResolver] = [
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("", views.dashboard, name="dashboard"),
    path("dashboard/counts/", views.dashboard_counts_fragment, name="dashboard_counts"),
    path("nav/counts/<slug:what>/", views.nav_count, name="nav_count"),
    path("search/", views.search, name="search"),
    path("kill-switch/banner/", views.killswitch_banner, name="killswitch_banner"),
    path("kill-switch/", views.killswitch_set, name="killswitch_set"),
    # approvals, actions, runs, tokens
    path("approvals/", inbox.approvals_inbox, name="approvals"),
    path("approvals/poll/", inbox.approvals_poll, name="approvals_poll"),
    # claims on approvals and conflicts ("Ana is on it")
    path("claims/<str:subject>/<uuid:item_id>/", claims.claim_box_view, name="claim_box"),
    path("claims/<str:subject>/<uuid:item_id>/take/", claims.claim_take_view, name="claim_take"),
    path(
        "claims/<str:subject>/<uuid:item_id>/release/",
        claims.claim_release_view,
        name="claim_release",
    ),
    path(
        "approvals/<uuid:approval_id>/decision/",
        inbox.approval_decide_view,
        name="approval_decide",
    ),
    path(
        "approvals/<uuid:approval_id>/edit/",
        inbox.approval_edit_view,
        name="approval_edit",
    ),
    path("actions/<uuid:action_id>/", runs.action_detail, name="action_detail"),
    path("actions/<uuid:action_id>/status/", runs.action_status, name="action_status"),
    path("plans/<uuid:plan_id>/", plans.plan_page, name="plan_detail"),
    path("plans/<uuid:plan_id>/decide/", plans.plan_decide_view, name="plan_decide"),
    path("runs/", runs.runs_list, name="runs"),
    path("runs/<uuid:run_id>/", runs.run_detail, name="run_detail"),
    path("runs/<uuid:run_id>/revoke/", runs.run_revoke_view, name="run_revoke"),
    path("tokens/", tokens.tokens_page, name="tokens"),
    path("tokens/personal/", tokens.personal_token_create, name="personal_token_create"),
    path(
        "tokens/personal/<int:token_id>/revoke/",
        tokens.personal_token_revoke,
        name="personal_token_revoke",
    ),
    path("tokens/agents/", tokens.agent_create, name="agent_create"),
    path(
        "tokens/agents/<uuid:agent_id>/tokens/",
        tokens.agent_token_create,
        name="agent_token_create",
    ),
    path(
        "tokens/agent-tokens/<int:token_id>/revoke/",
        tokens.agent_token_revoke,
        name="agent_token_revoke",
    ),
    # auto-approve rules (admins edit)
    path("rules/", rules.rules_page, name="rules"),
    path("rules/new/", rules.rule_create_view, name="rule_create"),
    path("rules/<int:rule_id>/", rules.rule_update_view, name="rule_update"),
    path("rules/<int:rule_id>/enabled/", rules.rule_enable_view, name="rule_enable"),
    path("rules/<int:rule_id>/delete/", rules.rule_delete_view, name="rule_delete"),
    path("grants/<int:grant_id>/revoke/", rules.grant_revoke_view, name="grant_revoke"),
    # people (admins manage)
    path("people/", people_views.people_page, name="people"),
    path("people/new/", people_views.person_create_view, name="person_create"),
    path("people/<int:person_id>/", people_views.person_update_view, name="person_update"),
    path("people/<int:person_id>/active/", people_views.person_active_view, name="person_active"),
    # conflicts, resources, catalog
    path("conflicts/", ownership_views.conflicts_list, name="conflicts"),
    path("conflicts/claims/", claims.conflict_claims_poll, name="conflict_claims_poll"),
    path(
        "conflicts/keep-current/",
        ownership_views.conflicts_keep_current,
        name="conflicts_keep_current",
    ),
    path("conflicts/<uuid:conflict_id>/", ownership_views.conflict_detail, name="conflict_detail"),
    path(
        "conflicts/<uuid:conflict_id>/preview/",
        ownership_views.conflict_preview,
        name="conflict_preview",
    ),
    path(
        "conflicts/<uuid:conflict_id>/resolution/",
        ownership_views.conflict_resolve_view,
        name="conflict_resolve",
    ),
    path("resources/", ownership_views.resources_list, name="resources"),
    path("resources/<path:identifier>/", ownership_views.resource_detail, name="resource_detail"),
    path(
        "operations/<int:operation_id>/undo/", ownership_views.operation_undo, name="operation_undo"
    ),
    path("catalog/", catalog_views.catalog, name="catalog"),
    path("catalog/classes/", catalog_views.conflict_class_save, name="conflict_class_save"),
    path("catalog/kinds/", catalog_views.resource_kind_save, name="resource_kind_save"),
    # audit
    path("audit/", audit_views.audit_list, name="audit"),
    path("audit/verify/", audit_views.audit_verify_badge, name="audit_verify"),
    path("audit/export.jsonl", audit_views.audit_export, name="audit_export"),
]
